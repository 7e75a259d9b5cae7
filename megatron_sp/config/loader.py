"""``load(conf_files, overrides, world_size)``: YAML/JSON files merged in order, dotted ``section.key=value``
overrides parsed to each field's type, then ``finalize`` (derived values, the config's own rules, the checks
each part registered). Every error is one ``ConfigError`` naming the key, the bad value and the fix."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError, read_utf8
from .registry import choice, did_you_mean, run_checks
from .registry import show as _show
from .schema import SECTIONS, Config, TokenizerConfig, TrainConfig

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
MAX_INT = 2**53  # every integer key below this (exact in a float and in JSON); 1e21 iterations is a typo
MAX_NEW_TOKENS = 100_000  # tokens generated per prompt: train.sample_tokens and tools/generate.py --max-new-tokens
MAX_NODES = 100_000  # values a config file may expand to (YAML aliases share, a printed or walked tree does not)
EXCLUSIVE = (("train.lr_warmup_iters", "train.lr_warmup_fraction"),)
"""Pairs of keys that say one thing two ways. One source (a file, the command line) sets one of them (both only when
they agree: a resolved config.yml holds both); a later source that sets one replaces the other's value (a note)."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (the last would win silently)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *defaults' merges; its keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: SafeLoader's own error follows
                continue
            if first != key_node.start_mark.line + 1:
                raise ConfigError(f"{self.name}: key '{_show(key)}' appears twice (lines {first} and "
                                  f"{key_node.start_mark.line + 1}); keep one (the last would win silently)")
        return super().construct_mapping(node, deep=deep)


def _json_pairs(source: str) -> Any:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ConfigError(f"{source}: key '{_show(key)}' appears twice in one object; keep one "
                                  "(the last would win silently)")
            out[key] = value
        return out
    return hook


def _count_nodes(data: Any, limit: int) -> int:
    """Values in ``data`` counting shared (aliased) parts every time they appear; stops past ``limit``."""
    count, stack = 0, [data]
    while stack and count <= limit:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


def _did_you_mean(name: str, options: list[str]) -> str:
    return did_you_mean(name, options) or f"; known keys: {', '.join(sorted(options))}"


def _number(value: Any) -> int | float | None:
    """``value`` as a number (a YAML number, or a string like 8, 1_000 or 3e-4), else None (booleans too)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        for parse in (lambda v: int(v.replace("_", "")), float):
            with contextlib.suppress(ValueError):
                return parse(value)
    return None


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert ``value`` (from YAML or a command-line string) to the field type ``tp``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in {"none", "null", "~"}):
            return None
        return _coerce(key, value, args[0])
    if value is None:
        raise ConfigError(f"{key}: null is not allowed (expected {getattr(tp, '__name__', tp)})")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(f"{key}: '{_show(value)}' is not a boolean; use true or false")
    if tp is int:
        number = _number(value)
        if isinstance(number, float):
            number = int(number) if math.isfinite(number) and number.is_integer() else None
        if number is None:
            raise ConfigError(f"{key}: '{_show(value)}' is not an integer; give a whole number like 8")
        if abs(number) >= MAX_INT:
            raise ConfigError(f"{key}: {_show(value)} is too large (at most 2^53); give a meaningful count")
        return number
    if tp is float:
        number = _number(value)
        if number is None:
            raise ConfigError(f"{key}: '{_show(value)}' is not a number; give e.g. 3e-4")
        if not math.isfinite(number):
            raise ConfigError(f"{key}: {_show(value)} is not a finite number; give e.g. 3e-4")
        return float(number)
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {type(value).__name__}")
        return str(value)
    if tp is list or origin is list:
        if isinstance(value, str):
            value = yaml.safe_load(value) if value.strip().startswith("[") else [v for v in value.split(",") if v]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got '{_show(value)}'; write [a, b] in YAML or a,b on the command line")
        return list(value)
    raise ConfigError(f"{key}: unsupported type {tp}")


def _apply_section(cfg: Config, section: str, values: Any, source: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"{source}: unknown section '{_show(section)}'{_did_you_mean(section, list(SECTIONS))}")
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: section '{section}' must be a mapping of keys, got '{_show(values)}'")
    target = getattr(cfg, section)
    types_ = typing.get_type_hints(type(target))  # every key of a section is a dataclass field
    for key, value in values.items():
        if key not in types_:
            known = [f"{section}.{k}" for k in types_]
            raise ConfigError(f"{source}: unknown key '{section}.{_show(key)}'{_did_you_mean(f'{section}.{key}', known)}")
        try:
            setattr(target, key, _coerce(f"{section}.{key}", value, types_[key]))
        except ConfigError as exc:
            if source.startswith("override"):  # the override names the key and value already
                raise
            raise ConfigError(f"{source}: {exc}") from None  # a file: say which


def read_file(path: str | Path) -> dict[str, Any]:
    """Read one YAML or JSON config file into a dict of sections (duplicate keys and alias bombs refused)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{p}' not found; pass an existing file to --conf (see configs/)")
    text = read_utf8(p, "config file", "pass a YAML or JSON config to --conf", ConfigError)
    kind = "JSON" if p.suffix == ".json" else "YAML"
    try:
        if kind == "JSON":
            data = json.loads(text, object_pairs_hook=_json_pairs(f"config file '{p}'"))
        else:
            loader = _StrictLoader(text)
            loader.name = f"config file '{p}'"
            try:
                data = loader.get_single_data()
            finally:
                loader.dispose()
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
        if mark is not None and problem:  # YAML: where, what, and in what (its first line is only the context)
            context = getattr(exc, "context", None)
            first = f"line {mark.line + 1}, column {mark.column + 1}: {problem}" + (f" ({context})" if context else "")
        raise ConfigError(f"config file '{p}' is not valid {kind}: {_show(first, 300)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{p}' must hold a mapping of sections (model:, parallel:, ...)")
    if _count_nodes(data, MAX_NODES) > MAX_NODES:
        raise ConfigError(f"config file '{p}' expands to more than {MAX_NODES} values (nested YAML aliases?); "
                          "a config is a few dozen keys")
    return data


def apply_override(cfg: Config, item: str) -> None:
    """Apply one ``section.key=value`` command-line override."""
    if "=" not in item:
        raise ConfigError(f"override '{item}' must look like section.key=value, e.g. parallel.tp=2")
    dotted, value = item.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"override '{item}': the key must be section.key, e.g. train.iters=50")
    _apply_section(cfg, parts[0], {parts[1]: value}, f"override '{item}'")


def _exclusive_values(cfg: Config) -> dict[str, Any]:
    return {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for pair in EXCLUSIVE for key in pair}


def _replace_exclusive(cfg: Config, before: dict[str, Any], keys: set[str], source: str,
                       notes: list[str] | None) -> None:
    """After ``source`` set ``keys``: each ``EXCLUSIVE`` key it set (not null) drops the other's earlier value."""
    now = _exclusive_values(cfg)
    for pair in EXCLUSIVE:
        for key, other in (pair, pair[::-1]):
            if key in keys and other not in keys and now[key] is not None and before[other] is not None:
                setattr(getattr(cfg, other.split(".")[0]), other.split(".")[1], None)
                if notes is not None:
                    notes.append(f"{key}={now[key]} ({source}) replaces {other}={before[other]} set before it")


def apply_sections(cfg: Config, data: dict[str, Any], source: str, notes: list[str] | None = None) -> None:
    """Apply one source's sections (a config file's, a checkpoint's); see ``EXCLUSIVE`` for ``notes``."""
    before = _exclusive_values(cfg)
    for section, values in data.items():
        _apply_section(cfg, str(section), values, source)
    keys = {f"{section}.{key}" for section, values in data.items() if isinstance(values, dict) for key in values}
    _replace_exclusive(cfg, before, keys, source, notes)


def apply_overrides(cfg: Config, items: list[str], notes: list[str] | None = None) -> None:
    """Apply the command line's dotted overrides, one source; see ``EXCLUSIVE`` for ``notes``."""
    before = _exclusive_values(cfg)
    for item in items:
        apply_override(cfg, item)
    _replace_exclusive(cfg, before, {item.split("=", 1)[0].strip() for item in items}, "command line", notes)


def load(conf_files: list[str | Path] | None = None, overrides: list[str] | None = None,
         world_size: int | None = None, finalize_config: bool = True, notes: list[str] | None = None) -> Config:
    """Defaults ← each file in order ← dotted overrides, then ``finalize``. ``world_size``: the ranks
    launched (torchrun's WORLD_SIZE), or None before launch; it derives an unset ``parallel.dp``. ``notes``
    receives a line for each ``EXCLUSIVE`` key a later source replaced (train.py logs them)."""
    cfg = Config()
    for path in conf_files or []:
        apply_sections(cfg, read_file(path), f"{path}", notes)
    apply_overrides(cfg, overrides or [], notes)
    if finalize_config:
        finalize(cfg, world_size)
    return cfg


def _check_mla(m: Any) -> None:
    """Multi-head latent attention's keys (``model.kv_lora_rank`` > 0): fills ``head_dim`` (nope + rope) and
    ``num_kv_heads`` (one key and value per head); refuses what MLA does not combine with, one line each."""
    mla_keys = ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_mscale_all_dim")
    defaults = {f.name: f.default for f in dataclasses.fields(type(m))}
    if not m.kv_lora_rank:
        changed = [k for k in mla_keys if getattr(m, k) != defaults[k]]
        if changed:
            raise ConfigError(f"model.{changed[0]} is set but model.kv_lora_rank is 0 (no latent attention); set "
                              "model.kv_lora_rank or drop the MLA keys")
        return
    for key in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if getattr(m, key) < 0 or (key in ("qk_rope_head_dim", "v_head_dim") and getattr(m, key) == 0):
            raise ConfigError(f"model.{key}: {getattr(m, key)} must be > 0" + (" (or 0)" if key == "q_lora_rank" else ""))
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    if m.qk_rope_head_dim % 2:
        raise ConfigError(f"model.qk_rope_head_dim: {m.qk_rope_head_dim} must be even (rotary turns pairs of dims)")
    if m.v_head_dim > qk:
        raise ConfigError(f"model.v_head_dim: {m.v_head_dim} above qk_nope_head_dim + qk_rope_head_dim = {qk} is not "
                          "available (values are padded to the query/key dims)")
    for key, bad in (("arch", m.arch != "llama"), ("qk_norm", m.qk_norm), ("qkv_bias", m.qkv_bias),
                     ("head_dim", m.head_dim not in (None, qk)),
                     ("num_kv_heads", m.num_kv_heads not in (None, m.num_heads))):
        if bad:
            raise ConfigError(f"model.{key}={getattr(m, key)} with model.kv_lora_rank (latent attention) is not "
                              f"available: MLA needs arch llama, no qk_norm or qkv_bias, head_dim nope + rope = {qk}, "
                              "num_kv_heads = num_heads")
    m.head_dim, m.num_kv_heads = qk, m.num_heads
    if m.rope_mscale_all_dim and m.rope_scaling != "yarn":
        raise ConfigError(f"model.rope_mscale_all_dim: {m.rope_mscale_all_dim} needs model.rope_scaling=yarn")


def _positive(cfg: Config, *keys: str, allow_zero: bool = False) -> None:
    for dotted in keys:
        section, key = dotted.split(".")
        v = getattr(getattr(cfg, section), key)
        if v is None:
            continue
        if v < 0 or (v == 0 and not allow_zero):
            raise ConfigError(f"{dotted}: {v} must be {'>= 0' if allow_zero else '> 0'}")


def check_tokenizer_keys(tk: TokenizerConfig, kind: str) -> None:
    """The keys tokenizer type ``kind`` needs (a model file) or refuses (the byte tokenizer's special tokens)."""
    if kind == "sentencepiece" and not tk.model:
        raise ConfigError("tokenizer.model is not set; give the SentencePiece .model path, or set tokenizer.type=byte")
    if kind == "hf" and not tk.model:
        raise ConfigError("tokenizer.model is not set; give the path of the Hugging Face tokenizer.json "
                          "(tokenizer.type=hf)")
    if kind == "byte" and (tk.eod_token is not None or tk.pad_token is not None):
        raise ConfigError("tokenizer.eod_token / tokenizer.pad_token: the byte tokenizer's special ids are fixed "
                          "(EOD 256, pad 257); drop these keys")


def _warmup(t: TrainConfig) -> None:
    """Derive ``lr_warmup_iters`` (0, or ``lr_warmup_fraction`` of ``lr_decay_iters``, rounded); refuse both set
    unless they agree (a resolved config holds both, and finalizing it again must pass)."""
    f = t.lr_warmup_fraction
    if f is None:
        t.lr_warmup_iters = 0 if t.lr_warmup_iters is None else t.lr_warmup_iters
        return
    if not 0.0 <= f <= 1.0:
        raise ConfigError(f"train.lr_warmup_fraction: {f} must be in [0, 1] (a share of train.lr_decay_iters)")
    derived = round(f * t.lr_decay_iters)  # type: ignore[operator]
    if t.lr_warmup_iters is not None and t.lr_warmup_iters != derived:
        raise ConfigError(f"train.lr_warmup_iters {t.lr_warmup_iters} and train.lr_warmup_fraction {f} are both set "
                          f"(the fraction gives {derived} of {t.lr_decay_iters} steps); set one of them, e.g. "
                          "train.lr_warmup_fraction=null")
    t.lr_warmup_iters = derived


_PLACEHOLDER = re.compile(r"\{[^{}]*\}")
_RUN_NAME = re.compile(r"[A-Za-z0-9._-]+")


def _name_paths(cfg: Config) -> None:
    """Substitute ``logging.name`` for '{name}' in ``logging.dir``, ``checkpoint.save`` and ``checkpoint.load``."""
    name = cfg.logging.name
    if not _RUN_NAME.fullmatch(name) or name in (".", ".."):
        raise ConfigError(f"logging.name: '{_show(name)}' must be letters, digits, '.', '_' or '-' (it names the "
                          "run's directories), e.g. logging.name=tp2")
    for section, key in (("logging", "dir"), ("checkpoint", "save"), ("checkpoint", "load")):
        value = getattr(getattr(cfg, section), key)
        if value is None:
            continue
        other = [m for m in _PLACEHOLDER.findall(value) if m != "{name}"]
        if other:
            raise ConfigError(f"{section}.{key}: '{_show(value)}' holds {other[0]}; only {{name}} (logging.name) is "
                              "substituted")
        setattr(getattr(cfg, section), key, value.replace("{name}", name))


def finalize(cfg: Config, world_size: int | None = None) -> Config:
    """Fill the derived values, check the config's own rules, then run every registered check. Idempotent."""
    m, p, t, d = cfg.model, cfg.parallel, cfg.train, cfg.data
    choice("model.arch", m.arch, ("neox", "llama"))
    choice("train.lr_decay_style", t.lr_decay_style, ("cosine", "linear", "constant"))
    choice("model.recompute", m.recompute, ("none", "selective", "full"))
    choice("tokenizer.type", cfg.tokenizer.type, ("sentencepiece", "hf", "byte"))
    choice("logging.level", cfg.logging.level, ("debug", "info", "warning"))
    _positive(cfg, "model.num_layers", "model.hidden_size", "model.num_heads", "model.num_kv_heads",
              "model.ffn_hidden_size", "model.seq_length", "model.ffn_multiple_of", "model.make_vocab_size_divisible_by",
              "parallel.tp", "parallel.pp", "parallel.cp", "parallel.dp", "parallel.virtual_stages",
              "parallel.timeout_s", "train.iters", "train.micro_batch_size", "train.global_batch_size",
              "train.eval_iters", "logging.interval", "train.sample_tokens", "tokenizer.vocab_size",
              "train.loss_scale_init", "train.loss_scale_window", "train.loss_scale_hysteresis",
              "data.prefetch_factor")
    _positive(cfg, "train.lr", "train.min_lr", "train.lr_warmup_iters", "train.weight_decay", "train.clip_grad",
              "train.eval_interval", "checkpoint.interval", "checkpoint.keep", "logging.dump_grads_step", "logging.peak_tflops",
              "model.hidden_dropout", "model.attention_dropout", "model.cpu_attention_max_scores", "model.sliding_window",
              "model.mtp_layers", "model.mtp_loss_coeff", "data.num_workers",
              allow_zero=True)
    for key in ("hidden_dropout", "attention_dropout"):
        if getattr(m, key) >= 1.0:
            raise ConfigError(f"model.{key}: {getattr(m, key)} must be below 1")
    _positive(cfg, "model.init_std", "model.norm_eps", "model.rotary_base", "train.adam_eps")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(t, key) < 1.0:
            raise ConfigError(f"train.{key}: {getattr(t, key)} must be in [0, 1) (AdamW's moment decay)")
    if t.sample_tokens > MAX_NEW_TOKENS:
        raise ConfigError(f"train.sample_tokens: {t.sample_tokens} is more than {MAX_NEW_TOKENS} tokens for the "
                          "end-of-training sample; use tools/generate.py for long generations")
    if not 0.0 <= t.label_smoothing < 1.0:  # also refuses nan
        raise ConfigError(f"train.label_smoothing: {t.label_smoothing} must be in [0, 1) (0 disables it)")
    if not (math.isfinite(t.z_loss) and t.z_loss >= 0.0):
        raise ConfigError(f"train.z_loss: {t.z_loss} must be a finite number >= 0 (0 disables it; PaLM used 1e-4)")

    # --- model shape ---
    _check_mla(m)
    if m.head_dim is None and m.hidden_size % m.num_heads:
        raise ConfigError(f"model.hidden_size {m.hidden_size} must be divisible by model.num_heads {m.num_heads}")
    if m.num_kv_heads is None:
        m.num_kv_heads = m.num_heads
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(f"model.num_kv_heads {m.num_kv_heads} must divide model.num_heads {m.num_heads}")
    if m.arch == "neox" and m.num_kv_heads != m.num_heads:
        raise ConfigError("model.num_kv_heads: grouped-query attention needs model.arch=llama (neox has one kv head per head)")
    if m.ffn_hidden_size is None:
        if m.arch == "neox":
            m.ffn_hidden_size = 4 * m.hidden_size
        else:
            raw = int(2 * 4 * m.hidden_size / 3)
            m.ffn_hidden_size = m.ffn_multiple_of * math.ceil(raw / m.ffn_multiple_of)
    if m.rotary_pct is None:
        m.rotary_pct = 0.25 if m.arch == "neox" else 1.0
    _positive(cfg, "model.head_dim", "model.rope_scaling_factor", "model.rope_original_max_positions")
    head_dim = m.head_dim = m.head_dim or m.hidden_size // m.num_heads
    choice("model.rope_scaling", m.rope_scaling, ("none", "linear", "llama3", "yarn"))
    choice("model.qk_norm_scope", m.qk_norm_scope, ("head", "projection"))
    choice("model.norm_placement", m.norm_placement, ("pre", "post_sublayer"))
    if m.sliding_window and m.attention_dropout > 0:
        raise ConfigError("model.sliding_window needs model.attention_dropout=0 (the windowed kernels have no dropout)")
    if m.qk_norm_scope != "head" and not m.qk_norm:
        raise ConfigError(f"model.qk_norm_scope={m.qk_norm_scope} needs model.qk_norm=true")
    if m.rope_scaling == "llama3" and not 0 < m.rope_low_freq_factor < m.rope_high_freq_factor:
        raise ConfigError(f"model.rope_low_freq_factor {m.rope_low_freq_factor} must be > 0 and below "
                          f"model.rope_high_freq_factor {m.rope_high_freq_factor}")
    if not 0.0 < m.rotary_pct <= 1.0:
        raise ConfigError(f"model.rotary_pct: {m.rotary_pct} must be in (0, 1]")
    rotary_dims = m.qk_rope_head_dim if m.kv_lora_rank else int(head_dim * m.rotary_pct)
    if rotary_dims == 0:
        raise ConfigError(f"model.rotary_pct: {m.rotary_pct} × head dim {head_dim} (hidden_size {m.hidden_size} / "
                          f"num_heads {m.num_heads}) gives no rotary dims; use fewer heads or a larger rotary_pct")
    if rotary_dims % 2:
        raise ConfigError(f"model.rotary_pct: {m.rotary_pct} × head dim {head_dim} must give an even number of rotary dims")

    # --- layout ---
    mp = p.tp * p.pp * p.cp
    if p.dp is None:
        if world_size is None:
            p.dp = 1
        elif world_size % mp:
            raise ConfigError(f"world size {world_size} is not divisible by tp·pp·cp = {p.tp}·{p.pp}·{p.cp} = {mp}; "
                              "launch a multiple of that many ranks")
        else:
            p.dp = world_size // mp
    derived_world = mp * p.dp
    if p.world_size is not None and p.world_size != derived_world:
        raise ConfigError(f"parallel.world_size {p.world_size} != tp·pp·cp·dp = {p.tp}·{p.pp}·{p.cp}·{p.dp} = {derived_world}")
    p.world_size = derived_world
    if world_size is not None and world_size != derived_world:
        raise ConfigError(f"launched {world_size} ranks but tp·pp·cp·dp = {p.tp}·{p.pp}·{p.cp}·{p.dp} = {derived_world}; "
                          "fix parallel.dp or the number of ranks")
    if m.num_heads % p.tp:
        raise ConfigError(f"model.num_heads {m.num_heads} must be divisible by parallel.tp {p.tp}")
    if m.num_kv_heads % p.tp and p.tp % m.num_kv_heads:
        raise ConfigError(f"model.num_kv_heads {m.num_kv_heads} and parallel.tp {p.tp}: one must divide the other "
                          "(kv heads are split over TP, or replicated when tp > num_kv_heads)")
    if m.ffn_hidden_size % p.tp:
        raise ConfigError(f"model.ffn_hidden_size {m.ffn_hidden_size} must be divisible by parallel.tp {p.tp}")
    if p.sequence_parallel and m.seq_length % p.tp:
        raise ConfigError(f"model.seq_length {m.seq_length} must be divisible by parallel.tp {p.tp} under "
                          "parallel.sequence_parallel")
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError("parallel.sequence_parallel needs parallel.tp > 1; set parallel.sequence_parallel=false")

    # --- batch ---
    per_step = t.micro_batch_size * p.dp
    if t.global_batch_size is None:
        t.global_batch_size = per_step * (t.grad_accum_steps or 1)
    if t.global_batch_size % per_step:
        raise ConfigError(f"train.global_batch_size {t.global_batch_size} must be a multiple of "
                          f"train.micro_batch_size·dp = {t.micro_batch_size}·{p.dp} = {per_step}")
    accum = t.global_batch_size // per_step
    if t.grad_accum_steps is not None and t.grad_accum_steps != accum:
        raise ConfigError(f"train.grad_accum_steps {t.grad_accum_steps} != global_batch_size / (micro_batch_size·dp) "
                          f"= {t.global_batch_size} / {per_step} = {accum}; drop one of them")
    t.grad_accum_steps = accum
    derived = t.lr_decay_iters is None
    if derived:
        t.lr_decay_iters = t.iters
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr {t.min_lr} must not exceed train.lr {t.lr}")
    _warmup(t)
    if t.lr_warmup_iters > t.lr_decay_iters:
        raise ConfigError(f"train.lr_warmup_iters {t.lr_warmup_iters} must not exceed train.lr_decay_iters "
                          f"{t.lr_decay_iters}{' (= train.iters)' if derived else ''}; set train.lr_warmup_iters "
                          f"<= {t.lr_decay_iters} or train.lr_decay_iters >= {t.lr_warmup_iters}")

    # --- data / tokenizer ---
    if d.build_demo:
        demo = Path(d.demo_dir)
        if not d.paths:
            d.paths = [str(demo / "demo_text_document")]
        if cfg.tokenizer.type == "sentencepiece" and cfg.tokenizer.model is None:
            cfg.tokenizer.model = str(demo / "tokenizer.model")
    check_tokenizer_keys(cfg.tokenizer, cfg.tokenizer.type)
    _name_paths(cfg)
    if cfg.checkpoint.save is None and cfg.checkpoint.interval:
        raise ConfigError("checkpoint.interval is set but checkpoint.save is not; set checkpoint.save=DIR")
    if cfg.checkpoint.save is None and cfg.checkpoint.auto_resume:
        raise ConfigError("checkpoint.auto_resume resumes from checkpoint.save's 'latest', but checkpoint.save is not "
                          "set; set checkpoint.save=DIR")
    run_checks(cfg)
    return cfg


def set_vocab(cfg: Config, vocab_size: int) -> None:
    """Record the model's vocabulary size (the tokenizer's ``vocab_size`` unless ``model.vocab_size`` is set: a model
    may have more rows than its tokenizer has ids, as Qwen's 151936 for 151669, never fewer) and derive the padded
    embedding size."""
    m = cfg.model
    if m.vocab_size is not None and m.vocab_size < vocab_size:
        raise ConfigError(f"model.vocab_size {m.vocab_size} is smaller than the tokenizer's {vocab_size} ids; "
                          "drop model.vocab_size or use the matching tokenizer")
    vocab_size = m.vocab_size = m.vocab_size or vocab_size
    multiple = m.make_vocab_size_divisible_by * cfg.parallel.tp
    padded = multiple * math.ceil(vocab_size / multiple)
    if m.padded_vocab_size is not None and m.padded_vocab_size != padded:
        raise ConfigError(f"model.padded_vocab_size {m.padded_vocab_size} != {padded} (vocab {vocab_size} padded to a "
                          f"multiple of {multiple}); drop model.padded_vocab_size")
    m.padded_vocab_size = padded


def to_dict(cfg: Config) -> dict[str, Any]:
    """The config as nested plain dicts (for YAML, JSON and checkpoints)."""
    return dataclasses.asdict(cfg)


def dumps(cfg: Config) -> str:
    """The resolved config as YAML text (what ``save`` writes)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def save(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as YAML (atomic: temp name then rename)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(dumps(cfg))
    tmp.replace(p)


def help_text() -> str:
    """Every key with its type, default and documentation, for ``train.py --help``."""
    lines = []
    for section, cls in SECTIONS.items():
        lines.append(f"{section}:  {cls.__doc__}")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            tname = getattr(hints[f.name], "__name__", str(hints[f.name]))
            lines.append(f"  {section}.{f.name} ({tname}, default {default!r}): {f.metadata.get('doc', '')}")
    return "\n".join(lines)
