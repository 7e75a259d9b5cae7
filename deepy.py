#!/usr/bin/env python3
"""Launch a script on several hosts, one torchrun per host (GPT-NeoX's deepy.py, without DeepSpeed).

    python deepy.py train.py --conf configs/410M.yml --hostfile hosts      # ssh to every host of 'hosts'
    python deepy.py --launcher slurm train.py --conf configs/410M.yml      # inside an allocation
    python deepy.py train.py --conf configs/demo.yml                       # no hostfile: this machine
    python deepy.py --dry-run ...                                          # print the commands only

The logic lives in ``megatron_sp/launcher.py``; ``python deepy.py --help`` lists every option.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_sp.launcher import main

if __name__ == "__main__":
    sys.exit(main())
