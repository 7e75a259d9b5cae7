"""tools/convert_checkpoint.py: export to HF transformers (logits, greedy tokens), import, re-layout, refusals."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_sp import checkpointing, config
from megatron_sp.model import GPTModel, generate_batch
from megatron_sp.optim import DistributedOptimizer, named_trainable
from tools import convert_checkpoint as convert

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

ROOT = Path(__file__).resolve().parents[2]

VOCAB = 258  # byte tokenizer
ARCH = {"neox": ["model.arch=neox", "model.ffn_hidden_size=256"],
        "llama": ["model.arch=llama", "model.num_kv_heads=2", "model.ffn_hidden_size=96"],
        "mixtral": ["model.arch=llama", "model.num_kv_heads=2", "model.ffn_hidden_size=96", "model.num_experts=4",
                    "model.moe_top_k=2", "model.moe_ffn_hidden_size=48"]}
ARCH["qwen2_moe"] = [*ARCH["mixtral"], "model.moe_shared_experts=1", "model.moe_first_dense_layers=1"]  # not a Mixtral
ARCH["sigmoid"] = [*ARCH["mixtral"], "model.moe_router_score=sigmoid"]  # a MoE llama no transformers class holds exactly
ARCH["mla"] = ["model.arch=llama", "model.ffn_hidden_size=96", "model.kv_lora_rank=16", "model.qk_nope_head_dim=8",
               "model.qk_rope_head_dim=8", "model.v_head_dim=8"]  # DeepSeek's latent attention
ARCH["mla_post"] = [*ARCH["mla"], "model.norm_placement=post_sublayer"]  # a latent model DeepseekV3 cannot hold
ARCH["mla_mtp"] = [*ARCH["mla"], "model.mtp_layers=1"]
ARCH["grouped"] = [*ARCH["mixtral"], "model.moe_router_groups=2"]


def save_ours(tmp_path: Path, arch: str, tied: bool = False, tokenizer: list[str] | None = None,
              vocab: int = VOCAB) -> tuple[Path, GPTModel]:
    """A tiny trained-looking model (perturbed norms and biases) saved with checkpointing.save, single process."""
    cfg = config.load(overrides=["data.paths=[x]", *(tokenizer or ["tokenizer.type=byte"]), "model.num_layers=2",
                                 "model.hidden_size=64",
                                 "model.num_heads=4", "model.seq_length=32", "model.rotary_base=500",
                                 "model.norm_eps=1e-6", f"model.tie_embeddings={tied}",
                                 f"checkpoint.save={tmp_path}/ckpt", *ARCH[arch]])
    config.set_vocab(cfg, vocab)
    model = GPTModel(cfg.model, seed=21)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    opt = DistributedOptimizer(named_trainable(model), cfg.train, None)
    checkpointing.save(cfg, 3, 12, model, opt, None, torch.device("cpu"))
    return tmp_path / "ckpt", model.eval()


def run(*args: str) -> int:
    return convert.main([str(a) for a in args])


def generate_cli(*args: str) -> dict:
    """tools/generate.py's --json object of one greedy prompt (a process of its own: it makes a process group)."""
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "generate.py"), *args, "--greedy", "--json"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("arch,tied", [("neox", False), ("llama", False), ("llama", True), ("mixtral", False),
                                       ("qwen2_moe", True)])
def test_export_to_hf_matches_logits_and_greedy_tokens(tmp_path: Path, arch: str, tied: bool) -> None:
    ckpt, model = save_ours(tmp_path, arch, tied)
    out = tmp_path / "hf"
    assert run("--input", ckpt, "--output", out, "--to", "hf") == 0
    assert {"config.json", "model.safetensors", "generation_config.json"} <= {p.name for p in out.iterdir()}
    hf_config = json.loads((out / "config.json").read_text())
    assert hf_config["vocab_size"] == VOCAB
    assert hf_config["architectures"] == [{"neox": "GPTNeoXForCausalLM", "llama": "LlamaForCausalLM",
                                           "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}[arch]]
    assert (hf_config["bos_token_id"], hf_config["eos_token_id"], hf_config["pad_token_id"]) == (256, 256, 257)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.dtype == torch.float32
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)[..., :VOCAB]
        theirs = hf(input_ids=tokens).logits
    rel = float((ours - theirs).abs().max() / theirs.abs().max())
    print(f"{arch} tied={tied}: max |Δlogit| / max |logit| = {rel:.2e}")
    assert rel <= 1e-5 and theirs.abs().max() > 0.1

    prompt = tokens[0, :8].tolist()
    mine = prompt + generate_batch(model, [prompt], 16, 256)[0].new_ids
    with torch.no_grad():
        hf_ids = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0].tolist()
    if 256 in hf_ids[len(prompt):]:  # HF appends the eos it stops at; ours does not
        hf_ids = hf_ids[:len(prompt) + hf_ids[len(prompt):].index(256)]
    assert mine == hf_ids


@pytest.mark.parametrize("arch", ["neox", "llama", "mixtral", "qwen2_moe"])
def test_hf_to_megatron_sp_to_hf_is_bit_identical(tmp_path: Path, arch: str) -> None:
    torch.manual_seed(0)
    if arch == "neox":
        hf_cfg = transformers.GPTNeoXConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                            intermediate_size=256, rotary_pct=0.25, max_position_embeddings=32)
        src_model = transformers.GPTNeoXForCausalLM(hf_cfg)
    elif arch == "mixtral":
        hf_cfg = transformers.MixtralConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=2, intermediate_size=48, max_position_embeddings=32,
                                            num_local_experts=4, num_experts_per_tok=2)
        src_model = transformers.MixtralForCausalLM(hf_cfg)
    elif arch == "qwen2_moe":  # top-1, the shared expert 2 experts wide, layers 0 and 2 dense
        hf_cfg = transformers.Qwen2MoeConfig(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                             num_key_value_heads=2, intermediate_size=96, max_position_embeddings=32,
                                             num_experts=4, num_experts_per_tok=1, moe_intermediate_size=24,
                                             shared_expert_intermediate_size=48, mlp_only_layers=[0, 2])
        src_model = transformers.Qwen2MoeForCausalLM(hf_cfg)
        with torch.no_grad():  # what ours can hold: no gate on the shared expert, no q/k/v biases
            for name, p in src_model.named_parameters():
                if name.endswith("shared_expert_gate.weight") or name.endswith("_proj.bias"):
                    p.zero_()
    else:
        hf_cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=96, max_position_embeddings=32,
                                          tie_word_embeddings=True)
        src_model = transformers.LlamaForCausalLM(hf_cfg)
    src = tmp_path / "src"
    src_model.save_pretrained(src)
    assert run("--input", src, "--output", tmp_path / "ours", "--to", "megatron_sp") == 0
    assert run("--input", tmp_path / "ours", "--output", tmp_path / "back", "--to", "hf") == 0
    a = safetensors_torch.load_file(src / "model.safetensors")
    b = safetensors_torch.load_file(tmp_path / "back" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name

    # our loader takes the converted checkpoint: weights only, fresh optimizer, step 0
    ckpt = checkpointing.resolve(tmp_path / "ours")
    meta = checkpointing.read_meta(ckpt)
    assert meta["step"] == 0 and not checkpointing.Reader(ckpt).names("optim/")
    cfg = convert.config_from_dict(meta["config"], "meta.json")
    model = GPTModel(cfg.model, seed=5)
    opt = DistributedOptimizer(named_trainable(model), cfg.train, None)
    checkpointing.load(ckpt, model, opt, None, torch.device("cpu"), seed=1)
    tokens = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model.eval()(tokens)[..., :300]
        theirs = src_model.eval()(input_ids=tokens).logits
    assert float((ours - theirs).abs().max() / theirs.abs().max()) <= 1e-5


def test_moe_without_an_exact_transformers_class_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ckpt, _ = save_ours(tmp_path, "sigmoid")
    assert run("--input", ckpt, "--output", tmp_path / "hf", "--to", "hf") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Qwen2MoeForCausalLM needs model.moe_router_score=softmax" in err
    assert not (tmp_path / "hf").exists()


def test_latent_model_exports_as_deepseek_v3_without_its_mtp_modules(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A dense latent-attention model trained with a multi-token prediction module exports as DeepseekV3ForCausalLM:
    the MTP module is dropped in one line (training-only), transformers' logits are ours."""
    ckpt, model = save_ours(tmp_path, "mla_mtp")
    with caplog.at_level("INFO"):
        assert run("--input", ckpt, "--output", tmp_path / "hf", "--to", "hf") == 0
    assert any("training-only" in r.getMessage() for r in caplog.records)
    assert not any("mtp" in k for k in safetensors_torch.load_file(tmp_path / "hf" / "model.safetensors"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(ids)[..., :VOCAB], hf(ids).logits
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()


@pytest.mark.parametrize("arch,says", [("mla_post", "DeepseekV3ForCausalLM needs model.norm_placement=pre"),
                                       ("grouped", "MixtralForCausalLM needs model.moe_router_groups=1")])
def test_deepseek_features_are_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture, arch: str,
                                                   says: str) -> None:
    ckpt, _ = save_ours(tmp_path, arch)
    assert run("--input", ckpt, "--output", tmp_path / "hf", "--to", "hf") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and says in err, err
    assert not (tmp_path / "hf").exists()


def test_qwen2_moe_export_imports_back_identical_and_refuses_a_gate(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Shared experts export as Qwen2-MoE with a zero shared_expert_gate and 2·down: tools/generate.py's greedy tokens
    are transformers'; importing gives our tensors bit for bit; a non-zero gate or q/k/v bias (which ours cannot
    hold) is one line naming the tensor, nothing written."""
    ckpt, model = save_ours(tmp_path, "qwen2_moe")
    assert run("--input", ckpt, "--output", tmp_path / "hf", "--to", "hf") == 0
    capsys.readouterr()
    mine = generate_cli("--load", str(ckpt), "--prompt", "def main(", "--max-new-tokens", "12")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        hf_ids = hf.generate(torch.tensor([mine["prompt_ids"]]), max_new_tokens=12, do_sample=False)[0].tolist()
    hf_new = hf_ids[len(mine["prompt_ids"]):]
    assert mine["new_ids"] == (hf_new[:hf_new.index(256)] if 256 in hf_new else hf_new) and mine["new_ids"]
    capsys.readouterr()  # transformers' loading progress
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert {k: hf_config[k] for k in ("mlp_only_layers", "decoder_sparse_step", "norm_topk_prob", "qkv_bias")} == {
        "mlp_only_layers": [0], "decoder_sparse_step": 1, "norm_topk_prob": True, "qkv_bias": True}
    assert run("--input", tmp_path / "hf", "--output", tmp_path / "back", "--to", "megatron_sp") == 0
    back = checkpointing.read_full(checkpointing.resolve(tmp_path / "back"))
    ours = {n: p[:VOCAB] if n in ("embedding.weight", "output_layer.weight") else p for n, p in model.named_parameters()}
    assert back.keys() == ours.keys()  # without the vocabulary padding rows
    for name, tensor in back.items():
        assert torch.equal(tensor, ours[name]), name
    model_cfg = checkpointing.read_meta(checkpointing.resolve(tmp_path / "back"))["config"]["model"]
    assert (model_cfg["moe_shared_experts"], model_cfg["moe_first_dense_layers"], model_cfg["moe_layer_freq"]) == (1, 1, 1)
    weights = safetensors_torch.load_file(tmp_path / "hf" / "model.safetensors")
    for bad in ("model.layers.1.mlp.shared_expert_gate.weight", "model.layers.0.self_attn.k_proj.bias"):
        changed = {**weights, bad: weights[bad] + 1e-3}
        (tmp_path / bad).mkdir()
        (tmp_path / bad / "config.json").write_text(json.dumps(hf_config))
        safetensors_torch.save_file(changed, tmp_path / bad / "model.safetensors")
        assert run("--input", tmp_path / bad, "--output", tmp_path / "refused", "--to", "megatron_sp") == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and f"{bad} is not zero" in err
        assert not (tmp_path / "refused").exists()


def test_qwen2_moe_layers_ours_cannot_hold_are_refused() -> None:
    raw = {"architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96,
           "num_hidden_layers": 4, "max_position_embeddings": 32, "vocab_size": 300, "num_experts": 4,
           "num_experts_per_tok": 2, "norm_topk_prob": True, "moe_intermediate_size": 24,
           "shared_expert_intermediate_size": 0}
    for layers, first, freq in (({}, 0, 1), ({"mlp_only_layers": [0, 2]}, 1, 2), ({"decoder_sparse_step": 4}, 3, 1)):
        cfg = convert.model_config_from_hf({**raw, **layers}, "config.json")
        assert (cfg.moe_first_dense_layers, cfg.moe_layer_freq, cfg.moe_shared_experts) == (first, freq, 0)
    assert convert.model_config_from_hf({**raw, "norm_topk_prob": False}, "config.json").moe_renormalize is False
    for bad, says in (({"mlp_only_layers": [2]}, "sparse layers [0, 1, 3]"),
                      ({"shared_expert_intermediate_size": 36}, "shared_expert_intermediate_size 36"),
                      ({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}, "some layers only")):
        with pytest.raises(convert.DataError, match=re.escape(says)):
            convert.model_config_from_hf({**raw, **bad}, "config.json")


def test_moe_with_a_learned_routing_bias_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ckpt, model = save_ours(tmp_path, "mixtral")
    cfg = convert.config_from_dict(checkpointing.read_meta(checkpointing.resolve(ckpt))["config"], "meta.json")
    opt = DistributedOptimizer(named_trainable(model), cfg.train, None)
    bias = {"0": [0.01, -0.01, 0.0, 0.0], "1": [0.0] * 4}  # what moe_bias_update_rate leaves in meta.json
    checkpointing.save(cfg, 4, 16, model, opt, None, torch.device("cpu"), extra={"moe_expert_bias": bias})
    assert run("--input", ckpt, "--output", tmp_path / "hf", "--to", "hf") != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "learned routing bias" in err and not (tmp_path / "hf").exists()
    # tools/generate.py routes with the bias, as training did
    from megatron_sp.model.moe import load_expert_bias
    load_expert_bias(model, bias)
    mine = generate_cli("--load", str(ckpt), "--prompt", "def main(", "--max-new-tokens", "12")
    assert mine["new_ids"] == generate_batch(model, [mine["prompt_ids"]], 12, 256)[0].new_ids


def test_relayout_records_target_layout_and_validates_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ckpt, _ = save_ours(tmp_path, "llama")
    assert run("--input", ckpt, "--output", tmp_path / "tp2", "--to", "megatron_sp", "--tp", "2") == 0
    assert run("--input", ckpt, "--output", tmp_path / "pp2", "--to", "megatron_sp", "--pp", "2") == 2
    assert "1f1b schedule needs at least pp" in capsys.readouterr().err  # the batch must fill the pipeline
    assert run("--input", ckpt, "--output", tmp_path / "pp2", "--to", "megatron_sp", "--pp", "2",
               "--set", "train.global_batch_size=2") == 0
    for name, tp, pp in (("tp2", 2, 1), ("pp2", 1, 2)):
        new = checkpointing.resolve(tmp_path / name)
        meta = checkpointing.read_meta(new)
        assert (meta["config"]["parallel"]["tp"], meta["config"]["parallel"]["pp"]) == (tp, pp)
        assert meta["config"]["parallel"]["world_size"] == tp * pp
        assert meta["step"] == 3 and meta["consumed_samples"] == 12
        old = checkpointing.resolve(ckpt)
        for f in ("index.json", "shards/rank_00000.safetensors"):
            assert (new / f).read_bytes() == (old / f).read_bytes()
    assert run("--input", ckpt, "--output", tmp_path / "tp3", "--to", "megatron_sp", "--tp", "3") == 2
    err = capsys.readouterr().err
    assert "num_heads 4 must be divisible by parallel.tp 3" in err and "Traceback" not in err
    assert run("--input", ckpt, "--output", tmp_path / "pp3", "--to", "megatron_sp", "--pp", "3") == 2
    assert not (tmp_path / "tp3").exists() and not (tmp_path / "pp3").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary leftovers


def test_relayout_changes_expert_parallelism(tmp_path: Path, capsys: pytest.CaptureFixture,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """A MoE checkpoint records another ep (the layout line names it); an ep that does not divide the folded ranks
    or the experts is one line, nothing written."""
    ckpt, _ = save_ours(tmp_path, "mixtral")
    with caplog.at_level("INFO", logger="megatron_sp"):
        assert run("--input", ckpt, "--output", tmp_path / "ep2", "--to", "megatron_sp",
                   "--set", "parallel.dp=2", "--set", "parallel.ep=2", "--set", "train.global_batch_size=2") == 0
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("target layout"))
    assert "dp 2 [--set]" in line and "ep 2 [--set]" in line and "= world 2" in line
    assert checkpointing.read_meta(checkpointing.resolve(tmp_path / "ep2"))["config"]["parallel"]["ep"] == 2
    for bad, says in ((["parallel.ep=2"], "parallel.ep: 2 must divide cp·dp = 1"),
                      (["parallel.dp=3", "parallel.ep=3", "train.global_batch_size=3"],
                       "model.num_experts: 4 must be divisible by parallel.ep 3")):
        args = [a for item in bad for a in ("--set", item)]
        assert run("--input", ckpt, "--output", tmp_path / "bad", "--to", "megatron_sp",
                   *args) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err and not (tmp_path / "bad").exists()


def test_relayout_prints_the_whole_target_layout(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """--tp 2 on a pp 2 checkpoint keeps pp 2: one line shows every layout value, the given ones marked by their flag
    and the others named as the source's; an HF import names the defaults instead."""
    ckpt, _ = save_ours(tmp_path, "llama")
    assert run("--input", ckpt, "--output", tmp_path / "pp2", "--to", "megatron_sp", "--pp", "2",
               "--set", "train.global_batch_size=2", "--set", "parallel.zero=1") == 0
    caplog.clear()
    with caplog.at_level("INFO", logger="megatron_sp"):
        assert run("--input", tmp_path / "pp2", "--output", tmp_path / "tp2", "--to", "megatron_sp", "--tp", "2") == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("target layout")]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    line = lines[0]
    assert "tp 2 [--tp], pp 2, cp 1, dp 1, virtual_stages 1, pp_schedule 1f1b" in line and "zero 1" in line
    assert "= world 4" in line and f"from the source {tmp_path / 'pp2' / 'iter_0000003'}: pp, cp, dp, virtual_stages" in line
    assert "sequence_parallel false" in line and "any layout loads this checkpoint" in line
    meta = checkpointing.read_meta(checkpointing.resolve(tmp_path / "tp2"))
    assert {k: meta["config"]["parallel"][k] for k in ("tp", "pp", "zero")} == {"tp": 2, "pp": 2, "zero": 1}

    caplog.clear()
    with caplog.at_level("INFO", logger="megatron_sp"):
        assert run("--input", tmp_path / "pp2", "--output", tmp_path / "zero0", "--to", "megatron_sp",
                   "--set", "parallel.zero=0") == 0
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("target layout"))
    assert "tp 1, pp 2" in line and "zero 0 [--set]" in line and "iter_0000003: tp, pp," in line


def test_refuses_existing_output_and_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ckpt, _ = save_ours(tmp_path, "neox")
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert run("--input", ckpt, "--output", out, "--to", "hf") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(out) in err and "not empty" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert run("--input", tmp_path / "nothing", "--output", tmp_path / "o", "--to", "hf") == 1
    assert "not a directory" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run("--input", ckpt, "--output", empty, "--to", "hf") == 0  # an empty directory is fine


def test_sentencepiece_tokenizer_is_exported_for_autotokenizer(tmp_path: Path) -> None:
    from megatron_sp.data.tokenizer import SentencePieceTokenizer, train_sentencepiece

    corpus = tmp_path / "corpus.jsonl"
    text = Path(checkpointing.store.__file__).read_text() + Path(convert.__file__).read_text()
    corpus.write_text("\n".join(json.dumps({"text": text[i:i + 2000]}) for i in range(0, len(text), 2000)))
    sp_model = train_sentencepiece([corpus], tmp_path / "tok", 600)
    ours = SentencePieceTokenizer(sp_model)
    ckpt, _ = save_ours(tmp_path, "llama", tokenizer=[f"tokenizer.model={sp_model}"], vocab=ours.vocab_size)
    out = tmp_path / "hf"
    assert run("--input", ckpt, "--output", out, "--to", "hf") == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.eos_token_id == ours.eod and len(hf_tok) == ours.vocab_size
    samples = ["def f(x):\n    return x  # ok\n", "\t  mixed\twhitespace  \n\n", "unicode é 漢字 \U0001F600 ~"]
    samples += [text[i:i + 400] for i in range(0, len(text), 400)]
    documented = ("\u2581", "<unk>", "<s>", "</s>", "<pad>")  # the two differences sentencepiece_to_tokenizers names
    samples = [x for x in samples if not any(d in x for d in documented)]
    assert len(samples) > 20
    for sample in samples:
        ids = hf_tok.encode(sample, add_special_tokens=False)
        assert ids == ours.encode(sample), sample[:60]
        assert hf_tok.decode(ids) == sample
    hf_config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    for ids in (hf_config, generation):  # the config's ids are the tokenizer's: bos 1, eos 2, pad 3
        assert (ids["bos_token_id"], ids["eos_token_id"], ids["pad_token_id"]) == (1, ours.eod, ours.pad) == (1, 2, 3)
    assert (hf_tok.bos_token_id, hf_tok.pad_token_id) == (1, 3)
    # every exported file has the mode of any file the user writes (safetensors alone would give 0600)
    import os
    umask = os.umask(0)
    os.umask(umask)
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {p.name: 0o666 & ~umask for p in out.iterdir()}


def test_help_exits_zero() -> None:
    p = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0
    for flag in ("--input", "--output", "--to", "--tp", "--pp", "--iteration", "--set", "layout-free",
                 "Converting is needed only between formats", "any layout"):
        assert flag in p.stdout
