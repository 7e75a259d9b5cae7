#!/usr/bin/env python3
"""Train a GPT: python train.py --conf configs/demo.yml [--conf more.yml] [section.key=value ...]

Run it plainly (it starts the local ranks the config needs) or under torchrun; both behave the same.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_sp.cli import main

if __name__ == "__main__":
    sys.exit(main())
