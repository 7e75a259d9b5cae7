#!/usr/bin/env python
"""Convert checkpoints between megatron_sp and Hugging Face transformers, or re-lay out ours.

    python tools/convert_checkpoint.py --input runs/ckpt --output export/hf --to hf
    python tools/convert_checkpoint.py --input export/hf --output runs/from_hf --to megatron_sp --tp 2
    python tools/convert_checkpoint.py --input runs/ckpt --output runs/ckpt_pp2 --to megatron_sp --pp 2

The input format is detected. Converting is needed only between formats: checkpoints are layout-free,
so train.py (checkpoint.load) and tools/generate.py load any of ours at any layout, unconverted. Ours to
ours only records another layout in the copied config (meta.json), checked against the model, tensors
copied unchanged: --tp/--pp (or --set parallel.KEY=VALUE, e.g. parallel.ep for a MoE) change those values, every
other one (cp, dp, virtual stages, schedule, ZeRO, ep, ...) stays the source's; the tool prints the whole target layout, naming
what came from the source. The output is written under a temporary name and renamed when complete.
Details: docs/checkpoints.md, "Converting".
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import logging
import os
import pickle
import re
import shutil
import sys
import uuid
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

if importlib.util.find_spec("megatron_sp") is None:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if str(Path(__file__).resolve().parent) not in sys.path:  # hf_import.py beside this script
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from megatron_sp import checkpointing
from megatron_sp.config import Config
from megatron_sp.config.loader import _apply_section, apply_override, finalize, set_vocab, to_dict
from megatron_sp.config.schema import ModelConfig
from megatron_sp.data.tokenizer import SPACE_SYMBOL
from megatron_sp.errors import ConfigError, DataError, OneLineArgumentParser, UserError, write_failure
from megatron_sp.model.hf_names import (DEEPSEEK_V3, from_hf_state_dict, hf_config_dict, to_hf_state_dict)
from megatron_sp.model.moe import is_moe_layer

from hf_import import model_config_from_hf

log = logging.getLogger("megatron_sp")

LAYOUT_KEYS = ("tp", "pp", "cp", "dp", "virtual_stages", "pp_schedule", "pp_partition", "sequence_parallel", "cp_algo",
               "cp_ulysses", "zero", "ep")  # the parallel.* values a checkpoint's config records as its layout


def layout_line(cfg: Config, tp: int | None, pp: int | None, overrides: list[str], rest: str) -> str:
    """The whole target layout of ``cfg`` in one line: values given by ``--tp``/``--pp``/``--set parallel.KEY``
    marked with their flag, the others said to come from ``rest`` (the source checkpoint, or the defaults)."""
    given = {"tp": "--tp" if tp is not None else "", "pp": "--pp" if pp is not None else ""}
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key.startswith("parallel."):
            given[key.removeprefix("parallel.")] = "--set"
    p = cfg.parallel

    def show(key: str) -> str:
        value = getattr(p, key)
        text = str(value).lower() if isinstance(value, bool) else str(value)
        return f"{key} {text}" + (f" [{given[key]}]" if given.get(key) else "")
    keys = [k for k in LAYOUT_KEYS if not (k == "cp_ulysses" and p.cp_algo != "usp" or k == "ep" and not cfg.model.num_experts)]
    values = [show(k) for k in keys]
    kept = [k for k in keys if not given.get(k)]
    return (f"target layout recorded: {', '.join(values)} = world {p.world_size}; from {rest}: {', '.join(kept)} "
            "(any layout loads this checkpoint: train.py runs the layout of its own config)")


def detect_format(path: Path) -> str:
    """'hf' or 'megatron_sp' for an input directory (DataError when it is neither)."""
    if not path.is_dir():
        raise DataError(f"--input '{path}' is not a directory")
    config_json = path / "config.json"
    if config_json.is_file():
        try:
            if "architectures" in json.loads(config_json.read_text()):
                return "hf"
        except (OSError, json.JSONDecodeError) as exc:
            raise DataError(f"'{config_json}' is not valid JSON ({exc})") from None
    if (path / "latest").is_file() or (path / "meta.json").is_file():
        return "megatron_sp"
    raise DataError(f"--input '{path}' is neither a Hugging Face model directory (config.json with 'architectures') "
                    "nor a megatron_sp checkpoint (a 'latest' or 'meta.json' file)")


def check_output(out: Path) -> None:
    """Refuse an output path that exists and is not an empty directory."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"--output '{out}' already exists and is not empty; choose a new directory or remove it")


@contextlib.contextmanager
def staging(out: Path, need: int) -> Iterator[Path]:
    """A temporary sibling directory of ``out``, renamed to ``out`` when the block succeeds, else removed; a write
    that fails (a full disk: ``OSError``, ``shutil.Error``) is one ``DataError`` naming the file and ``need`` bytes."""
    check_output(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        yield tmp
        check_output(out)  # nobody created it meanwhile
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except OSError as exc:  # safetensors' own error is raised as an OSError by store.save_safetensors
        raise DataError(f"--output '{out}' not written, nothing left behind: {write_failure(tmp, exc, need)}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def config_from_dict(sections: dict[str, Any], source: str) -> Config:
    """A Config from a saved (resolved) config dict; unknown keys are an error."""
    cfg = Config()
    for section, values in sections.items():
        _apply_section(cfg, str(section), values, source)
    return cfg


def validated(cfg: Config, source: str) -> Config:
    """``cfg`` finalized (every cross-field check) for its own ``parallel`` layout, world size and gradient
    accumulation recomputed; an unset data path or tokenizer model does not fail it (training sets them)."""
    cfg = copy.deepcopy(cfg)
    cfg.parallel.world_size = None
    cfg.train.grad_accum_steps = None
    probe = copy.deepcopy(cfg)
    if not probe.data.paths:
        probe.data.paths = ["<unset>"]
    if probe.tokenizer.type == "sentencepiece" and not probe.tokenizer.model:
        probe.tokenizer.model = "<unset>"
    try:
        finalize(probe)
    except ConfigError as exc:
        raise ConfigError(f"{source}: the target layout does not fit this model: {exc}") from None
    probe.data.paths, probe.tokenizer.model = cfg.data.paths, cfg.tokenizer.model
    return probe


def check_weights(weights: dict[str, torch.Tensor], cfg: ModelConfig, source: str) -> None:
    """Names and shapes of ``weights`` are those of a GPTModel built from ``cfg`` (built on the meta device)."""
    from megatron_sp.model import GPTModel
    from megatron_sp.mpu.sharding import stored_name, stored_shape
    from megatron_sp.optim import named_trainable

    with torch.device("meta"):
        model = GPTModel(cfg, seed=0)
    expected = {stored_name(n, p): stored_shape(p, 1) for n, p in named_trainable(model)}
    missing, unexpected = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise DataError(f"{source}: the weights do not match the model config: missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise DataError(f"{source}: '{name}' has shape {tuple(weights[name].shape)}, the model config needs {shape}")


def read_ours(path: Path, iteration: int | None) -> tuple[Path, dict[str, Any], Config, dict[str, torch.Tensor]]:
    """(checkpoint dir, meta, config, full weights by name) of the newest (or ``iteration``) checkpoint."""
    if iteration is not None:
        if (path / "meta.json").is_file():
            raise ConfigError(f"--iteration: '{path}' is already one checkpoint directory; drop --iteration")
        path = path / f"iter_{iteration:07d}"
        if not (path / "meta.json").is_file():
            raise DataError(f"--iteration {iteration}: '{path}' is missing or incomplete")
    ckpt = checkpointing.resolve(path)
    meta = checkpointing.read_meta(ckpt)
    cfg = config_from_dict(meta.get("config", {}), f"{ckpt / 'meta.json'}")
    weights = checkpointing.read_full(ckpt)
    check_weights(weights, cfg.model, str(ckpt / checkpointing.INDEX))
    return ckpt, meta, cfg, weights


def write_ours(root: Path, meta: dict[str, Any], weights: dict[str, torch.Tensor] | None,
               copy_from: Path | None = None) -> Path:
    """Lay out a checkpoint.save directory in ``root``: iter_NNNNNNN/{index.json, shards/, meta.json}, then ``latest``;
    with full ``weights``, or the tensors of checkpoint ``copy_from`` copied unchanged."""
    ckpt = root / f"iter_{int(meta['step']):07d}"
    ckpt.mkdir()
    if weights is not None:
        checkpointing.write_weights(ckpt, meta, weights)
    if copy_from is not None:
        shutil.copy2(copy_from / checkpointing.INDEX, ckpt / checkpointing.INDEX)
        shutil.copytree(copy_from / checkpointing.store.SHARDS, ckpt / checkpointing.store.SHARDS)
    (ckpt / "meta.json").write_text(json.dumps({**meta, "format_version": checkpointing.FORMAT_VERSION}, indent=1))
    (root / "latest").write_text(ckpt.name + "\n")
    return ckpt


def relayout(src: Path, out: Path, iteration: int | None, tp: int | None, pp: int | None,
             overrides: list[str]) -> Path:
    """megatron_sp → megatron_sp with the target layout recorded (weights and optimizer state copied as they are)."""
    ckpt, meta, cfg, _ = read_ours(src, iteration)
    cfg.parallel.tp = tp if tp is not None else cfg.parallel.tp
    cfg.parallel.pp = pp if pp is not None else cfg.parallel.pp
    for item in overrides:
        apply_override(cfg, item)
    cfg = validated(cfg, f"--tp {cfg.parallel.tp} --pp {cfg.parallel.pp}")
    log.info("%s", layout_line(cfg, tp, pp, overrides, f"the source {ckpt}"))
    meta = {**meta, "config": to_dict(cfg), "converted_from": str(ckpt.resolve())}
    with staging(out, sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())) as tmp:
        write_ours(tmp, meta, None, copy_from=ckpt)
    log.info("wrote %s (weights%s copied unchanged)", out,
             " and optimizer state" if checkpointing.Reader(ckpt).names("optim/") else "")
    return out / f"iter_{int(meta['step']):07d}"


def sentencepiece_to_tokenizers(model: Path) -> Any:
    """A ``tokenizers.Tokenizer`` that encodes like our SentencePiece BPE model, without protobuf (the mapping:
    docs/checkpoints.md, "Converting")."""
    import sentencepiece as spm
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    sp = spm.SentencePieceProcessor(model_file=str(model))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    special = [i for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)]
    merges = []
    for piece, pid in vocab.items():
        if pid in special or sp.is_byte(pid):
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                merges.append((pid, vocab[left], vocab[right], left, right))
    merges.sort()  # ids follow SentencePiece's scores: a lower id merges first
    unk = sp.id_to_piece(sp.unk_id()) if sp.unk_id() >= 0 else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges], unk_token=unk,
                               byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", SPACE_SYMBOL)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE_SYMBOL, " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(sp.id_to_piece(i), special=True, normalized=False) for i in special])
    return tok


def _tokenizer_file(cfg: Config) -> Path | None:
    """The checkpoint's SentencePiece model or HF tokenizer.json when it is found from here, else None."""
    model = Path(cfg.tokenizer.model or "")
    model = model / "tokenizer.json" if cfg.tokenizer.type == "hf" and model.is_dir() else model
    return model if cfg.tokenizer.type in ("sentencepiece", "hf") and model.is_file() else None


def _tokenizer_files(cfg: Config, tmp: Path) -> str:
    """tokenizer.json + tokenizer_config.json for ``AutoTokenizer``: a SentencePiece model converted (the original
    tokenizer.model copied too), an HF tokenizer.json copied."""
    if cfg.tokenizer.type not in ("sentencepiece", "hf"):
        return f"no tokenizer files (tokenizer.type={cfg.tokenizer.type} has no Hugging Face equivalent)"
    model = _tokenizer_file(cfg)
    if model is None:
        return f"no tokenizer files ({cfg.tokenizer.model!r} is not found from here)"
    from megatron_sp.data.tokenizer import SentencePieceTokenizer, build_tokenizer

    ours = build_tokenizer(cfg.tokenizer)  # validates the file and applies tokenizer.eod_token / pad_token
    if isinstance(ours, SentencePieceTokenizer):
        sentencepiece_to_tokenizers(model).save(str(tmp / "tokenizer.json"))
        shutil.copy2(model, tmp / "tokenizer.model")
        sp = ours._sp
        piece: Callable[[int], str | None] = lambda i: sp.id_to_piece(i) if i >= 0 else None
        unk, bos = piece(sp.unk_id()), piece(sp.bos_id())
    else:
        shutil.copy2(model, tmp / "tokenizer.json")
        piece = ours._tok.id_to_token  # type: ignore[attr-defined]
        unk, bos = None, piece(ours.eod)  # BOS = EOD, as special_token_ids says
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, "unk_token": unk,
              "bos_token": bos, "eos_token": piece(ours.eod), "pad_token": piece(ours.pad)}
    (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return f"tokenizer.json from {model}"


def special_token_ids(cfg: Config) -> dict[str, int]:
    """``bos/eos/pad_token_id`` of the checkpoint's tokenizer as HF configs spell them ({} when it is not found):
    EOS = our EOD, pad = our pad, BOS = the tokenizer's own BOS piece if any, else EOD (as GPT-2/NeoX do)."""
    from megatron_sp.data.tokenizer import SentencePieceTokenizer, build_tokenizer

    if cfg.tokenizer.type != "byte" and not (cfg.tokenizer.model and Path(cfg.tokenizer.model).exists()):
        return {}
    tok = build_tokenizer(cfg.tokenizer)
    bos = int(tok._sp.bos_id()) if isinstance(tok, SentencePieceTokenizer) else -1
    return {"bos_token_id": bos if bos >= 0 else tok.eod, "eos_token_id": tok.eod, "pad_token_id": tok.pad}


def to_hf(src: Path, out: Path, iteration: int | None) -> Path:
    """megatron_sp → a Hugging Face directory loadable by ``AutoModelForCausalLM.from_pretrained``."""
    ckpt, meta, cfg, weights = read_ours(src, iteration)
    if _tokenizer_file(cfg) is not None and importlib.util.find_spec("tokenizers") is None:
        raise ConfigError("--to hf writes the tokenizer's tokenizer.json with the 'tokenizers' package, which is not "
                          "installed: pip install -e '.[hf]'")
    m, bias = cfg.model, meta.get("moe_expert_bias") or {}
    if not m.kv_lora_rank and any(any(b) for b in bias.values()):
        raise DataError(f"{ckpt}: its experts are chosen with a learned routing bias (model.moe_bias_update_rate), "
                        "which transformers' MoE classes other than DeepseekV3ForCausalLM (latent attention) have no "
                        "place for: the export would route differently")
    if mtp := [n for n in weights if n.startswith(("mtp.", "mtp_embedding."))]:
        log.info("dropped the %d multi-token prediction tensors (mtp.*): MTP modules are training-only", len(mtp))
    weights = {n: t for n, t in weights.items() if n not in mtp}
    if m.num_experts:  # the routing bias as the router's buffer: DeepSeek-V3's e_score_correction_bias
        weights.update({f"layers.{i}.mlp.router.expert_bias": torch.tensor(bias.get(str(i)) or [0.0] * m.num_experts)
                        for i in range(m.num_layers) if is_moe_layer(m, i)})
    vocab = weights["embedding.weight"].shape[0]  # stored without the layout's padding rows
    special = special_token_ids(cfg)
    interleave = meta.get("hf_rope_interleave", True)  # DeepSeek-V3's rotary layout, as imported (default: the Hub's)
    hf_cfg = {**hf_config_dict(m, prefer=meta.get("hf_class"), rope_interleave=interleave), "vocab_size": vocab,
              "torch_dtype": "float32", **special}
    state = {name: t.detach().to(torch.float32).contiguous().clone()
             for name, t in to_hf_state_dict(weights, m, rope_interleave=interleave).items()}
    with staging(out, sum(t.nbytes for t in state.values())) as tmp:
        checkpointing.store.save_safetensors(state, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=1))
        (tmp / "generation_config.json").write_text(json.dumps({"do_sample": False, **special}, indent=1))
        note = _tokenizer_files(cfg, tmp)
    log.info("wrote %s (%s, %d tensors, vocab %d) from %s; %s", out, hf_cfg["architectures"][0], len(state), vocab,
             ckpt, note)
    return out


def load_pickled_weights(path: Path) -> dict[str, torch.Tensor]:
    """A ``pytorch_model.bin``: ``torch.load(weights_only=True)`` (no pickled code runs), one-line errors."""
    try:
        weights = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"'{path}' is corrupted, truncated or holds more than tensors ({first[:120]})") from None
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise DataError(f"'{path}' does not hold a dict of tensors")
    return weights


def read_hf_weights(src: Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF directory: model.safetensors, its sharded index, or pytorch_model.bin (weights only)."""
    from safetensors.torch import load_file

    if (src / "model.safetensors").is_file():
        return load_file(str(src / "model.safetensors"))
    index = src / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {k: v for f in files for k, v in load_file(str(src / f)).items()}
    if (src / "pytorch_model.bin").is_file():
        return load_pickled_weights(src / "pytorch_model.bin")
    raise DataError(f"'{src}' has no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def _token_text(tokenizer_json: Path, token_id: Any) -> str | None:
    """The text of id ``token_id`` (an HF config's ``eos_token_id``...) in ``tokenizer_json``, or None."""
    try:
        tok = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # HFTokenizer reports a malformed file when it is used
    for added in tok.get("added_tokens") or []:
        if isinstance(token_id, int) and added.get("id") == token_id:
            return added.get("content")
    vocab = (tok.get("model") or {}).get("vocab")
    return next((k for k, v in vocab.items() if v == token_id), None) if isinstance(vocab, dict) else None


def from_hf(src: Path, out: Path, tp: int | None, pp: int | None, overrides: list[str]) -> Path:
    """Hugging Face directory → a megatron_sp checkpoint.save directory at step 0 (no optimizer state)."""
    raw = json.loads((src / "config.json").read_text())
    cfg = Config()
    cfg.model = model_config_from_hf(raw, str(src / "config.json"))
    cfg.parallel.tp, cfg.parallel.pp = tp or 1, pp or 1
    set_vocab(cfg, cfg.model.vocab_size)  # the padding is the layout's; the stored rows are the HF vocabulary
    has_sp, has_json = (src / "tokenizer.model").is_file(), (src / "tokenizer.json").is_file()
    cfg.tokenizer.type = ("sentencepiece" if has_sp else "hf" if has_json else
                          "byte" if cfg.model.vocab_size == 258 else "sentencepiece")
    if cfg.tokenizer.type == "hf":  # the HF config's EOS and pad, which HFTokenizer's defaults may not find
        cfg.tokenizer.eod_token, cfg.tokenizer.pad_token = (_token_text(src / "tokenizer.json", raw.get(key))
                                                            for key in ("eos_token_id", "pad_token_id"))
    for item in overrides:
        apply_override(cfg, item)
    hf_weights = read_hf_weights(src)
    deepseek = raw["architectures"][0] == DEEPSEEK_V3
    beyond = [n for n in hf_weights if (layer := re.match(r"model\.layers\.(\d+)\.", n)) and
              int(layer.group(1)) >= cfg.model.num_layers] if deepseek else []
    if beyond:  # DeepSeek-V3's layer 61
        log.info("ignored the %d tensors of the multi-token prediction layers (model.layers.%d and on): ours "
                 "(model.mtp_layers) are trained from scratch", len(beyond), cfg.model.num_layers)
    interleave = bool(raw.get("rope_interleave", True))
    try:
        ours = from_hf_state_dict({n: t for n, t in hf_weights.items() if n not in beyond}, cfg.model,
                                  rope_interleave=interleave)
    except (KeyError, ValueError) as exc:
        raise DataError(f"'{src}': {exc.args[0] if exc.args else exc}") from None
    bias = {n.split(".")[1]: ours.pop(n).double().tolist() for n in [n for n in ours if n.endswith(".expert_bias")]}
    weights = {n: t.detach().to(torch.float32).contiguous().clone() for n, t in ours.items()}
    check_weights(weights, cfg.model, str(src))
    with staging(out, sum(t.nbytes for t in weights.values())) as tmp:
        for name in ("tokenizer.model", "tokenizer.json"):  # the tokenizer goes with the weights
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
        own = {"sentencepiece": "tokenizer.model", "hf": "tokenizer.json"}.get(cfg.tokenizer.type, "")
        if cfg.tokenizer.model is None and own and (tmp / own).is_file():
            cfg.tokenizer.model = str(out.resolve() / own)
        cfg = validated(cfg, f"'{src}' at --tp {cfg.parallel.tp} --pp {cfg.parallel.pp}")
        log.info("%s", layout_line(cfg, tp, pp, overrides, "the defaults (a Hugging Face model has no layout)"))
        meta = {"format_version": checkpointing.FORMAT_VERSION, "step": 0, "consumed_samples": 0,
                "world_size": cfg.parallel.world_size, "config": to_dict(cfg), "converted_from": str(src.resolve()),
                "hf_class": raw["architectures"][0],  # exported back as it (a Llama-shaped Mistral stays a Mistral)
                **({"moe_expert_bias": bias} if bias else {}),  # DeepSeek-V3's e_score_correction_bias, as training keeps it
                **({"hf_rope_interleave": interleave} if deepseek else {})}
        ckpt = write_ours(tmp, meta, weights)
    log.info("wrote %s/%s (%s, %d tensors, step 0, no optimizer state, tokenizer.type=%s); set data.paths%s to train "
             "from it", out, ckpt.name, cfg.model.arch, len(weights), cfg.tokenizer.type,
             "" if cfg.tokenizer.model or cfg.tokenizer.type == "byte" else " and tokenizer.model")
    return out / ckpt.name


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, type=Path, metavar="DIR",
                        help="an HF model directory, a checkpoint.save directory or one iter_NNNNNNN directory")
    parser.add_argument("--output", required=True, type=Path, metavar="DIR",
                        help="directory to create (must not exist or be empty)")
    parser.add_argument("--to", required=True, choices=("megatron_sp", "hf"), help="target format")
    parser.add_argument("--tp", type=int, metavar="N",
                        help="--to megatron_sp: tensor-parallel size recorded in the output's config (default: the "
                             "input's; any layout loads the checkpoint, so this only records one)")
    parser.add_argument("--pp", type=int, metavar="N",
                        help="--to megatron_sp: pipeline-parallel size recorded in the output (default: the input's)")
    parser.add_argument("--iteration", type=int, metavar="STEP",
                        help="megatron_sp input: convert iter_STEP instead of the one 'latest' names")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="--to megatron_sp: a config override for the output's meta.json (repeatable), e.g. "
                             "parallel.dp=4 or parallel.virtual_stages=1 for a layout value --tp/--pp do not set")
    args = parser.parse_args(argv)
    for flag in ("tp", "pp"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag} must be at least 1, got {value}")
        if value is not None and args.to == "hf":
            parser.error(f"--{flag} applies to --to megatron_sp only (HF files have no parallel layout)")
    if args.overrides and args.to == "hf":
        parser.error("--set applies to --to megatron_sp only")
    return args


def convert(args: argparse.Namespace) -> Path:
    """Run one conversion; returns the written path."""
    source = detect_format(args.input)
    check_output(args.output)
    if source == "hf":
        if args.to == "hf":
            raise ConfigError(f"--input '{args.input}' is already a Hugging Face directory; use --to megatron_sp")
        if args.iteration is not None:
            raise ConfigError("--iteration applies to megatron_sp input only")
        return from_hf(args.input, args.output, args.tp, args.pp, args.overrides)
    if args.to == "hf":
        return to_hf(args.input, args.output, args.iteration)
    return relayout(args.input, args.output, args.iteration, args.tp, args.pp, args.overrides)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        convert(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
