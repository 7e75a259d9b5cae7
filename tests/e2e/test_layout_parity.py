"""Every layout meets the parity standard against the 1-rank run (docs/parity.md).

One table: (model overrides shared with the reference run, layout overrides). Each run trains
5 steps via train.py and is compared by ``parity.compare_runs``: per-step loss within 5e-6
relative, step-1 grad norm within 1e-6 (it is accumulated in fp64), every full gradient within 1e-5 of max|ref|.
"""
from __future__ import annotations

import pytest

from megatron_sp.parity import compare_runs

from .runs import PARITY, metrics, train

LLAMA = ["model.arch=llama", "model.num_heads=4", "model.num_kv_heads=2", "model.ffn_multiple_of=32"]
TIED = LLAMA + ["model.tie_embeddings=true"]
SP = ["parallel.sequence_parallel=true"]
L4 = ["model.num_layers=4"]
PACKED = ["data.reset_attention_mask=true", "data.reset_position_ids=true"]
INTERLEAVED = ["parallel.pp_schedule=interleaved", "parallel.virtual_stages=2"]
MOE = LLAMA + ["model.num_experts=4", "model.moe_ffn_hidden_size=64", "model.moe_z_loss_coeff=1e-3",
               "model.moe_capacity_factor=1.5"]
MOE_NEOX = ["model.num_experts=4", "model.moe_ffn_hidden_size=64", "model.moe_top_k=1", "model.moe_shared_experts=1",
            "model.moe_capacity_factor=1.5"]
# The open-model families' features (docs/families.md): Qwen2/Qwen3 (q/k/v bias, per-head QK-norm, head_dim apart from
# hidden/heads), OLMo-2 (norms after the sublayers, QK-norm over the whole projection), Llama-3.1 and yarn rope
# scaling (original context 16 < seq 64, so the scaling acts), Mistral's sliding window, Qwen3-MoE routing.
QWEN3 = LLAMA + ["model.qkv_bias=true", "model.qk_norm=true", "model.head_dim=24"]
OLMO2 = LLAMA + ["model.norm_placement=post_sublayer", "model.qk_norm=true", "model.qk_norm_scope=projection"]
ROPE_LLAMA3 = LLAMA + ["model.rope_scaling=llama3", "model.rope_scaling_factor=8", "model.rope_original_max_positions=16"]
ROPE_YARN = LLAMA + ["model.rope_scaling=yarn", "model.rope_scaling_factor=4", "model.rope_original_max_positions=16"]
WINDOW = LLAMA + ["model.sliding_window=20"]
WINDOW_PACKED = WINDOW + PACKED
QWEN3_MOE = QWEN3 + ["model.num_experts=4", "model.moe_ffn_hidden_size=64", "model.moe_top_k=2",
                     "model.moe_renormalize=true", "model.moe_capacity_factor=1.5"]
# DeepSeek's multi-head latent attention: a query latent (or none), values narrower than queries/keys; with MoE
MLA = ["model.arch=llama", "model.num_heads=4", "model.ffn_multiple_of=32", "model.kv_lora_rank=16",
       "model.q_lora_rank=24", "model.qk_nope_head_dim=12", "model.qk_rope_head_dim=4", "model.v_head_dim=8"]
MLA_NO_Q_LATENT = MLA[:4] + ["model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=16"]
MOE_CP = LLAMA + ["model.num_experts=4", "model.moe_ffn_hidden_size=64", "model.moe_z_loss_coeff=1e-3",
                  "model.moe_shared_experts=1", "model.moe_router_score=sigmoid", "model.moe_bias_update_rate=1e-2",
                  "model.moe_router_groups=2", "model.moe_router_group_topk=1", "model.moe_routed_scaling=2.5"]
# DeepSeek-V3 as a whole: latent attention, grouped sigmoid routing with the bias, a dense first layer, and two
# multi-token prediction modules (MoE layers too; their losses are compared as well)
DEEPSEEK = MLA + MOE_CP[4:] + ["model.moe_first_dense_layers=1", "model.mtp_layers=2", "model.mtp_loss_coeff=0.3"]

# Muon (train.optimizer=muon): the update of each logical matrix assembled whole under every layout (split heads on the
# MoE model's fused QKV)
MUON = LLAMA + ["train.optimizer=muon"]
MUON_MOE = MOE + ["train.optimizer=muon", "train.muon_split_heads=true"]

# Each row is one train.py run (~10 s): a feature alone once, then in combinations. Rows whose
# paths a combination already runs were folded into it (dp4 → dp3_zero1_odd, tp4 → tp4_sp and the
# kv-replicated tp4, tp2_sp_dp2 → dp2_tp2_sp_zero1, pp2_zero_bubble → its tp2_sp / dp2_zero1 rows,
# cp2_ring → cp2_ring_dp2; dp2 → dp2_eod_masked and dp2_zero1, tp2_sp → its recompute and llama rows, pp2 →
# pp2_tp2_sp and llama_tied_pp2, cp2_zigzag → cp2_zigzag_tp2_sp and cp2_zigzag_pp2, cp2_ulysses → llama_gqa_cp2_ulysses,
# packed_cp2_zigzag → packed_cp2_zigzag_tp2_sp; dp2_zero1 → dp2_tp2_sp_zero1 and muon_dp4_zero1, dp2_zero2 →
# dp2_tp2_sp_zero2, pp2_zero_bubble_dp2_zero2 → its zero-3 row (ZeRO-3 stages gradients as ZeRO-2 does), moe_ep2_dp4_zero1
# → qwen3_moe_ep2_dp4_zero1, the DeepSeek and tied-MTP interleaved rows → their ZeRO-3 rows) to keep the whole suite
# inside its 15-minute budget on 2 cores;
# tools/fuzz_parity.py draws further combinations (tests/e2e/test_fuzz_parity.py runs a seeded sample).
LAYOUTS = {
    # data parallelism, ZeRO-1 (odd dp: padded buckets), uneven masking
    "dp2_eod_masked": (["data.eod_mask_loss=true"], ["parallel.dp=2"]),  # ranks hold different token counts
    "dp3_zero1_odd": (["train.global_batch_size=12"], ["parallel.dp=3", "parallel.zero=1"]),  # padded buffer
    "dp2_tp2_sp_zero1": ([], ["parallel.dp=2", "parallel.tp=2", *SP, "parallel.zero=1"]),
    # ZeRO-2 (grads reduce-scattered per micro-batch into the shard): TP+SP, PP (tied), CP, and expert buckets over edp
    # in the MoE block below
    "dp2_tp2_sp_zero2": ([], ["parallel.dp=2", "parallel.tp=2", *SP, "parallel.zero=2"]),
    "llama_tied_pp2_dp2_zero2": (TIED, ["parallel.pp=2", "parallel.dp=2", "parallel.zero=2"]),
    "cp2_ring_dp2_zero2": ([], ["parallel.cp=2", "parallel.dp=2", "parallel.zero=2"]),
    # ZeRO-3 (parameters sharded, gathered per layer with prefetch): alone at dp4 (bf16 masters in the optimizer's
    # gloo test), TP+SP, PP (tied 1F1B, zero-bubble), CP with full recompute and packed documents; MoE and MTP below
    "dp4_zero3": ([], ["parallel.dp=4", "parallel.zero=3"]),
    "dp2_tp2_sp_zero3": ([], ["parallel.dp=2", "parallel.tp=2", *SP, "parallel.zero=3"]),
    "llama_tied_pp2_dp2_zero3": (TIED, ["parallel.pp=2", "parallel.dp=2", "parallel.zero=3"]),
    "pp2_zero_bubble_dp2_zero3": ([], ["parallel.pp=2", "parallel.pp_schedule=zero_bubble", "parallel.dp=2",
                                       "parallel.zero=3", "parallel.zero3_prefetch=2"]),
    "packed_cp2_zigzag_dp2_zero3_recompute": (PACKED + ["model.recompute=full"],
                                              ["parallel.cp=2", "parallel.cp_algo=zigzag", "parallel.dp=2",
                                               "parallel.zero=3"]),
    # tensor + sequence parallelism
    "tp2": ([], ["parallel.tp=2"]),
    "tp4_sp": ([], ["parallel.tp=4", *SP]),
    "tp2_sp_no_recompute_allgather": ([], ["parallel.tp=2", *SP, "parallel.tp_recompute_allgather=false"]),
    "tp2_sp_full_recompute": ([], ["parallel.tp=2", *SP, "model.recompute=full"]),
    "tp2_sp_selective_recompute": ([], ["parallel.tp=2", *SP, "model.recompute=selective"]),
    "llama_gqa_tp2_sp": (LLAMA, ["parallel.tp=2", *SP]),
    "llama_gqa_tp4_kv_replicated": (LLAMA, ["parallel.tp=4", *SP]),
    "llama_tied_tp2_sp": (TIED, ["parallel.tp=2", *SP]),
    # pipeline: 1F1B, interleaved, zero-bubble, no pipelining, uneven split
    "pp4": (L4, ["parallel.pp=4"]),
    "pp2_tp2_sp": ([], ["parallel.pp=2", "parallel.tp=2", *SP]),
    "pp2_dp2_zero1": ([], ["parallel.pp=2", "parallel.dp=2", "parallel.zero=1"]),
    "llama_tied_pp2": (TIED, ["parallel.pp=2"]),
    "pp2_interleaved_v2": (L4, ["parallel.pp=2", *INTERLEAVED]),
    "llama_tied_pp2_interleaved_v2": (TIED + L4, ["parallel.pp=2", *INTERLEAVED]),
    "pp2_zero_bubble_tp2_sp": ([], ["parallel.pp=2", "parallel.pp_schedule=zero_bubble", "parallel.tp=2", *SP]),
    "pp2_zero_bubble_dp2_zero1": ([], ["parallel.pp=2", "parallel.pp_schedule=zero_bubble", "parallel.dp=2",
                                       "parallel.zero=1"]),
    "pp2_no_pipelining": ([], ["parallel.pp=2", "parallel.pp_schedule=none"]),
    "pp2_uneven_1_3": (L4, ["parallel.pp=2", "parallel.pp_partition=1,3"]),
    # context parallelism: every algorithm, with TP+SP, DP, PP, and packed documents
    "cp2_llama3": ([], ["parallel.cp=2", "parallel.cp_algo=llama3"]),
    "cp4_zigzag": ([], ["parallel.cp=4", "parallel.cp_algo=zigzag"]),
    "llama_gqa_cp2_ulysses": (LLAMA, ["parallel.cp=2", "parallel.cp_algo=ulysses"]),
    "cp2_zigzag_tp2_sp": ([], ["parallel.cp=2", "parallel.cp_algo=zigzag", "parallel.tp=2", *SP]),
    "cp2_ring_dp2": ([], ["parallel.cp=2", "parallel.dp=2"]),
    "cp2_zigzag_pp2": ([], ["parallel.cp=2", "parallel.cp_algo=zigzag", "parallel.pp=2"]),
    "cp4_usp_ulysses2": ([], ["parallel.cp=4", "parallel.cp_algo=usp", "parallel.cp_ulysses=2"]),
    "packed_cp2_llama3": (PACKED, ["parallel.cp=2", "parallel.cp_algo=llama3"]),
    # packed documents on the document-aligned kernel under the other algorithms, cp4 and TP+SP
    "packed_cp2_ring": (PACKED, ["parallel.cp=2", "parallel.cp_algo=ring"]),
    "packed_cp2_ulysses": (PACKED, ["parallel.cp=2", "parallel.cp_algo=ulysses"]),
    "packed_cp4_usp_ulysses2": (PACKED, ["parallel.cp=4", "parallel.cp_algo=usp", "parallel.cp_ulysses=2"]),
    "packed_cp2_zigzag_tp2_sp": (PACKED, ["parallel.cp=2", "parallel.cp_algo=zigzag", "parallel.tp=2", *SP]),
    # every document zigzagged on its own (the default only splits documents of >= 2·cp·128 tokens)
    "packed_cp4_zigzag_every_document": (PACKED, ["parallel.cp=4", "parallel.cp_algo=zigzag",
                                                  "parallel.cp_document_chunk=1"]),
    # MoE expert parallelism (docs/moe.md): ep folded from dp; tp replicas; ZeRO-1 over edp (ep2 × dp4: edp 2; ep4 ×
    # dp4, edp 1, runs in test_layout_checkpoints' resume); pp stages in the interleaved row below (1F1B was a row of
    # its own until the suite's time asked for it)
    "moe_ep2_tp2": (MOE, ["parallel.dp=2", "parallel.ep=2", "parallel.tp=2"]),
    "moe_ep2_dp4_zero2": (MOE, ["parallel.dp=4", "parallel.ep=2", "parallel.zero=2"]),
    "moe_ep2_dp4_zero3": (MOE, ["parallel.dp=4", "parallel.ep=2", "parallel.zero=3"]),
    "moe_ep2_tp2_sp_dp2_zero2": (MOE, ["parallel.tp=2", *SP, "parallel.dp=2", "parallel.ep=2", "parallel.zero=2"]),
    "moe_ep2_tp2_sp_dp2_zero3": (MOE, ["parallel.tp=2", *SP, "parallel.dp=2", "parallel.ep=2", "parallel.zero=3"]),
    # under SP the TP ranks route their own tokens: ep folds over tp too (capacity decided on the gathered sequence);
    # CP: the balancing losses count the whole sequence (dropless: capacity needs positions); interleaved stages
    "moe_ep2_tp2_sp": (MOE, ["parallel.tp=2", *SP, "parallel.ep=2"]),
    "moe_shared_bias_ep2_cp2_zigzag": (MOE_CP, ["parallel.cp=2", "parallel.cp_algo=zigzag", "parallel.ep=2"]),
    "moe_shared_bias_ep4_cp2_llama3_tp2_sp": (MOE_CP, ["parallel.cp=2", "parallel.cp_algo=llama3", "parallel.tp=2", *SP,
                                                       "parallel.ep=4"]),
    "moe_ep2_pp2_interleaved": (MOE + L4, ["parallel.dp=2", "parallel.ep=2", "parallel.pp=2", *INTERLEAVED]),
    # expert tensor parallelism: each expert's matrices split over the TP ranks (neox: the output bias on TP rank 0)
    "moe_ep2_etp2_tp2": (MOE, ["parallel.dp=2", "parallel.ep=2", "parallel.tp=2", "parallel.expert_tp=2"]),
    "moe_neox_shared_etp2_tp2": (MOE_NEOX, ["parallel.tp=2", "parallel.expert_tp=2"]),
    # open-model families: each feature under TP+SP, PP (interleaved), every CP algorithm, DP+ZeRO-1, EP
    "qwen3_tp2_sp_pp2_interleaved": (QWEN3 + L4, ["parallel.tp=2", *SP, "parallel.pp=2", *INTERLEAVED]),
    "qwen3_cp2_ulysses_dp2_zero1": (QWEN3, ["parallel.cp=2", "parallel.cp_algo=ulysses", "parallel.dp=2",
                                            "parallel.zero=1"]),
    "olmo2_tp2_sp_cp2_zigzag": (OLMO2, ["parallel.tp=2", *SP, "parallel.cp=2", "parallel.cp_algo=zigzag"]),
    "olmo2_pp2_dp2_zero1": (OLMO2, ["parallel.pp=2", "parallel.dp=2", "parallel.zero=1"]),
    "rope_llama3_cp2_llama3_tp2_sp": (ROPE_LLAMA3, ["parallel.cp=2", "parallel.cp_algo=llama3", "parallel.tp=2", *SP]),
    "rope_yarn_cp2_ring_pp2": (ROPE_YARN, ["parallel.cp=2", "parallel.cp_algo=ring", "parallel.pp=2"]),
    "window_cp4_zigzag": (WINDOW, ["parallel.cp=4", "parallel.cp_algo=zigzag"]),
    "window_tp2_sp_pp2": (WINDOW, ["parallel.tp=2", *SP, "parallel.pp=2"]),
    "window_packed_cp2_ring_dp2": (WINDOW_PACKED, ["parallel.cp=2", "parallel.cp_algo=ring", "parallel.dp=2"]),
    "window_packed_cp2_llama3": (WINDOW_PACKED, ["parallel.cp=2", "parallel.cp_algo=llama3"]),
    "window_packed_cp2_ulysses_tp2_sp": (WINDOW_PACKED, ["parallel.cp=2", "parallel.cp_algo=ulysses", "parallel.tp=2",
                                                         *SP]),
    "window_packed_cp4_usp_ulysses2": (WINDOW_PACKED, ["parallel.cp=4", "parallel.cp_algo=usp", "parallel.cp_ulysses=2"]),
    "qwen3_moe_ep2_tp2_sp": (QWEN3_MOE, ["parallel.tp=2", *SP, "parallel.ep=2"]),
    "qwen3_moe_ep2_dp4_zero1": (QWEN3_MOE, ["parallel.dp=4", "parallel.ep=2", "parallel.zero=1"]),
    # multi-head latent attention (docs/attention.md): heads over TP with the latent gathered under SP, every CP
    # algorithm (values padded to the query/key dims), pipeline stages, ZeRO-1, recompute, packed documents
    "mla_tp2_sp_pp2_interleaved": (MLA + L4, ["parallel.tp=2", *SP, "parallel.pp=2", *INTERLEAVED]),
    "mla_cp2_zigzag_tp2_sp": (MLA, ["parallel.cp=2", "parallel.cp_algo=zigzag", "parallel.tp=2", *SP]),
    "mla_cp4_usp_ulysses2": (MLA, ["parallel.cp=4", "parallel.cp_algo=usp", "parallel.cp_ulysses=2"]),
    "mla_packed_cp2_llama3_dp2_zero1": (MLA + PACKED, ["parallel.cp=2", "parallel.cp_algo=llama3", "parallel.dp=2",
                                                       "parallel.zero=1"]),
    "mla_no_q_latent_tp4_full_recompute": (MLA_NO_Q_LATENT, ["parallel.tp=4", "model.recompute=full"]),
    "mla_moe_groups_ep2_cp2_ring": (MLA + MOE_CP[4:], ["parallel.cp=2", "parallel.cp_algo=ring", "parallel.ep=2"]),
    "deepseek_mtp_moe_tp2_sp_ep2": (DEEPSEEK, ["parallel.tp=2", *SP, "parallel.ep=2"]),
    "deepseek_mtp_moe_tp2_pp2": (DEEPSEEK, ["parallel.tp=2", "parallel.pp=2"]),  # the last stage's embedding copy
    "deepseek_mtp_moe_cp2_zigzag": (DEEPSEEK, ["parallel.cp=2", "parallel.cp_algo=zigzag"]),
    "deepseek_mtp_moe_packed_cp2_llama3": (DEEPSEEK + PACKED, ["parallel.cp=2", "parallel.cp_algo=llama3"]),
    # ZeRO-3 with MTP: the last stage's embedding copy and the shared head gathered for each module
    "deepseek_mtp_moe_pp2_dp2_zero3_ep2": (DEEPSEEK, ["parallel.pp=2", "parallel.dp=2", "parallel.zero=3",
                                                      "parallel.ep=2"]),
    "mtp_tied_pp2_interleaved_dp2_zero3": (TIED + L4 + ["model.mtp_layers=1"], ["parallel.pp=2", *INTERLEAVED,
                                                                                "parallel.dp=2", "parallel.zero=3"]),
    "muon_tp2_sp": (MUON, ["parallel.tp=2", *SP]),
    "muon_pp2_interleaved": (MUON + L4, ["parallel.pp=2", *INTERLEAVED]),
    "muon_dp4_zero1": (MUON, ["parallel.dp=4", "parallel.zero=1"]),
    "muon_dp2_tp2_zero1": (MUON, ["parallel.dp=2", "parallel.tp=2", "parallel.zero=1"]),
    "muon_cp2_dp2_zero3": (MUON, ["parallel.cp=2", "parallel.dp=2", "parallel.zero=3"]),
    "muon_moe_ep2": (MUON_MOE, ["parallel.dp=2", "parallel.ep=2"]),
    "muon_moe_ep2_tp2_sp_zero1": (MUON_MOE, ["parallel.tp=2", *SP, "parallel.dp=2", "parallel.ep=2", "parallel.zero=1"]),
}
MOE_METRICS = ("moe_aux_loss", "moe_z_loss", "moe_load_imbalance", "moe_dropped_tokens", "moe_tokens_per_expert")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_parity(tmp_path, byte_data, packed_data, reference_run, name):
    model, layout = LAYOUTS[name]
    data = packed_data if "data.reset_attention_mask=true" in model else byte_data  # short documents, several a sample
    ref = reference_run(*model, data=data)
    train(tmp_path, data, *PARITY, *model, *layout)
    report = compare_runs(ref, tmp_path / "log")
    assert report.ok, f"{name}: {report.describe()}"
    assert len(report.steps) == 5 and report.worst_grad[0] != "(none)"
    world = 1
    for item in layout:
        if item.startswith(("parallel.dp=", "parallel.tp=", "parallel.pp=", "parallel.cp=")):
            world *= int(item.split("=")[1])
    assert metrics(tmp_path)[1]["world_size"] == world
    if "moe" in name:  # the balancing losses, loads and drops do not depend on the layout either
        for step, row in metrics(tmp_path).items():
            want = metrics(ref.parent)[step]
            assert row["moe_tokens_per_expert"] == want["moe_tokens_per_expert"], (name, step)
            for key in MOE_METRICS[:-1]:  # (Muon's orthogonalisation spreads the rounding: the losses' tolerance)
                rel = 5e-6 if "muon" in name else 1e-6
                assert row[key] == pytest.approx(want[key], rel=rel, abs=1e-12), (name, step, key)
