"""Lesson 16's planner (``common.planner``): its memory prediction against what lesson 13's GPT really holds, its
enumeration on hand-made shapes, its ranking on hand-made clusters whose answer is obvious, and bad input.

The measurement is ``common.experiments.activations.step_memory``: one AdamW step of ``common.gpt.GPT`` on one CPU
process, the model state read from the tensors themselves (``common.memory.local_bytes``) and the activations from
the storages that forward leaves alive (``common.activations.HeldMemory``), not from any formula. Tolerance: the
model state exactly; the activations within 1%, for what the formula leaves out (the loss itself and a few
small tensors, about 1 KiB here).
"""

import json
import subprocess
from argparse import Namespace

import pytest
import torch

from common.experiments.activations import build_gpt, step_memory
from common.gpt import GPT
from common.launch import run_on_ranks
from common.parallelize import pipeline_split
from common.pipeline import transformer_stage_blocks
from common.planner import (
    MESH_ORDER,
    MODELS,
    Cluster,
    Config,
    Model,
    Training,
    activation_bytes,
    collective_calls,
    device_parameters,
    enumerate_configs,
    gpt_model,
    link,
    measured_cluster,
    pipeline_divides,
    predict_memory,
    predict_step_time,
    rank_configs,
    ring_seconds,
    sharded_parameters,
    stage_blocks,
)
from tests.conftest import PYTHON, REPO, load_script

GPT_CONFIG = dict(context=32, d_model=32, num_heads=4, num_layers=2, dropout=0.1)
BATCH = 4
SMALL_GPT = gpt_model(256, 32, 32, 4, 2, dropout=0.1)  # GPT_CONFIG as the planner sees it
# One CPU process: the memory is not the point here; masks in the activations' dtype, as on a CPU (lesson 13).
ONE_CPU = Cluster("one CPU process", 1, 1, 1e9, 1e11, 0, 0, 0, 0, mask_bytes=None)


def two_nodes(inter_beta: float, memory_bytes: float = 1e12) -> Cluster:
    """2 nodes of 4 devices: a fast link inside a node, ``inter_beta`` seconds per byte between nodes."""
    return Cluster("2 x 4", 4, 2, memory_bytes, 1e12, 1e-6, 1e-10, 1e-5, inter_beta)


# A model whose every dimension divides by 8, so that every mesh of 8 devices is allowed.
WIDE = Model("wide", layers=8, hidden=1024, heads=16, vocab=1024, seq=256)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_predicted_memory_of_lesson_13s_gpt_is_what_one_process_measures(recompute):
    assert SMALL_GPT.num_parameters() == sum(p.numel() for p in build_gpt(GPT_CONFIG).parameters())
    config = Config(micro_batch=BATCH, recompute=recompute)
    training = Training(BATCH, precision="fp32")
    predicted = predict_memory(SMALL_GPT, ONE_CPU, training, config)
    measured = step_memory(GPT_CONFIG, BATCH, recompute)
    for part in ("parameters", "gradients", "optimizer"):
        assert predicted[part] == measured[part], part
    # Measured after forward: what recomputation keeps, without the one block it rebuilds at a time in backward.
    activations = activation_bytes(SMALL_GPT, ONE_CPU, training, config)
    kept = activations["total"] - activations["recompute buffer"]
    assert kept == pytest.approx(measured["activations"], rel=0.01)


def test_the_enumeration_keeps_exactly_the_meshes_the_shapes_allow():
    # 4 devices; 2 layers, 2 heads, a sequence of 4 and a batch of 2: every degree is 1 or 2 (tp 4 > 2 heads, pp 4
    # leaves no block to the end stages, 2 cp = 8 > the sequence, dp 4 > the batch). Products of 4: two of them 2.
    model = Model("tiny", layers=2, hidden=4, heads=2, vocab=8, seq=4)
    cluster = Cluster("4", 4, 1, 1e9, 1e12, 0, 0, 0, 0)
    configs = enumerate_configs(model, cluster, Training(2), recompute=("none",), zero_stages=(0,))
    degrees = {(c.dp, c.tp, c.pp, c.cp) for c in configs}
    assert degrees == {(2, 2, 1, 1), (2, 1, 2, 1), (2, 1, 1, 2), (1, 2, 2, 1), (1, 2, 1, 2), (1, 1, 2, 2)}
    batches = {(c.dp, c.micro_batch, c.micro_batches) for c in configs}
    assert batches == {(2, 1, 1), (1, 1, 2), (1, 2, 1)}  # dp x micro-batch x micro-batches = 2, every way


def test_the_planner_and_pipeline_split_lay_out_the_blocks_alike_llama_3s_end_stages_one_fewer():
    assert transformer_stage_blocks(6, 4) == [1, 2, 2, 1]  # 6 + 2 = 4 x 2: the ends leave room for embedding, head
    assert transformer_stage_blocks(126, 16) == [7] + [8] * 14 + [7]
    assert transformer_stage_blocks(8, 4) == [2, 2, 2, 2] and transformer_stage_blocks(5, 4) == [2, 1, 1, 1]
    model = gpt_model(256, 16, 16, 2, 6)
    held = []
    for stage in range(4):
        torch.manual_seed(0)
        part, first = pipeline_split(GPT(256, 16, 16, 2, 6, 0.0), stage, 4)
        assert first == sum(stage_blocks(model, 4)[:stage]) and len(part.blocks) == stage_blocks(model, 4)[stage]
        held.append(sum(p.numel() for p in part.parameters() if p is not None))
    assert device_parameters(model, Config(pp=4)) == max(held)  # the fullest stage, as the ranks hold it


def test_a_pipeline_stage_holds_whole_blocks_llama_3s_126_layers_on_16_stages_included():
    assert pipeline_divides(126, 7) and pipeline_divides(126, 16)  # 16 x 8 = 126 + 2: end stages take one fewer
    assert not pipeline_divides(126, 12) and not pipeline_divides(2, 4)  # 2 + 2 = 4 x 1 leaves the ends no block
    model, cluster = MODELS["llama3-405b"], Cluster("16", 16, 1, 1e12, 1e15, 0, 0, 0, 0)
    stages = {c.pp for c in enumerate_configs(model, cluster, Training(16), ("none",), (0,))}
    assert stages == {1, 2, 4, 8, 16}  # 126 = 2 x 63; 128 = 4 x 32 = 8 x 16 = 16 x 8
    # Llama 3's layout: 7 blocks on the end stages, 8 in the middle; under 1F1B stage 1 holds 15 micro-batches of
    # 8 blocks, more than stage 0's 16 of 7: the fullest stage is a middle one, for parameters and activations.
    config = Config(dp=1, pp=16, micro_batch=1, micro_batches=16)
    assert device_parameters(model, config) == 8 * model.layer_parameters()
    assert activation_bytes(model, cluster, Training(16), config)["in flight"] == 15


def test_only_the_configurations_under_the_memory_limit_are_ranked():
    training = Training(8)
    configs = enumerate_configs(WIDE, two_nodes(1e-9), training)
    memory = sorted(predict_memory(WIDE, two_nodes(1e-9), training, c)["total"] for c in configs)
    limit = memory[len(memory) // 2]  # half of them fit
    ranked = rank_configs(WIDE, two_nodes(1e-9, memory_bytes=limit), training)
    assert {plan.config for plan in ranked} == {
        c for c in configs if predict_memory(WIDE, two_nodes(1e-9), training, c)["total"] <= limit
    }
    assert 0 < len(ranked) < len(configs)
    times = [plan.time["total"] for plan in ranked]
    assert times == sorted(times)


def test_the_mesh_is_laid_out_tp_innermost_then_cp_dp_and_pp():
    assert MESH_ORDER == ("pp", "dp", "cp", "tp")
    cluster = two_nodes(1e-9)
    assert link(cluster, Config(dp=2, tp=4), ("tp",))[2] == "intra"  # ranks 0-3 are one node
    assert link(cluster, Config(dp=2, tp=4), ("dp",))[2] == "inter"  # ranks 0 and 4: two nodes
    assert link(cluster, Config(dp=4, tp=2), ("tp",))[2] == "intra"
    assert link(cluster, Config(pp=2, tp=4), ("pp",))[2] == "inter"
    assert link(cluster, Config(dp=2, cp=2, pp=2), ("dp", "cp"))[2] == "intra"  # dp x cp inside, pp across
    assert link(cluster, Config(tp=8), ("tp",))[2] == "inter"


def test_on_a_slow_inter_node_link_tensor_parallelism_stays_inside_a_node():
    # Wide layers, short sequences, a small batch: big gradients, small activations, so tensor parallelism pays.
    wider, training = Model("wider", layers=8, hidden=4096, heads=32, vocab=1024, seq=64), Training(8)
    even = two_nodes(inter_beta=1e-10)  # between nodes as fast as inside
    best = rank_configs(wider, even, training)[0].config
    assert best.tp == 8 and link(even, best, ("tp",))[2] == "inter", best.describe()  # across nodes when free
    slow = two_nodes(inter_beta=1e-6)  # 1 MB/s between nodes, 10 GB/s inside
    best = rank_configs(wider, slow, training)[0].config
    assert best.tp > 1 and link(slow, best, ("tp",))[2] == "intra", best.describe()


def test_with_memory_for_a_replica_data_parallelism_wins_and_without_it_the_planner_shards():
    training, unsharded = Training(64), dict(recompute=("none",), zero_stages=(0,))  # 8 sequences per rank
    fast = two_nodes(inter_beta=1e-10)
    best = rank_configs(WIDE, fast, training, **unsharded)[0].config
    assert (best.dp, best.tp, best.pp, best.cp) == (8, 1, 1, 1), best.describe()
    replica = predict_memory(WIDE, fast, training, Config(dp=8, micro_batch=1, micro_batches=8))["total"]
    tight = two_nodes(inter_beta=1e-10, memory_bytes=0.6 * replica)
    best = rank_configs(WIDE, tight, training, **unsharded)[0].config
    assert best.tp * best.pp * best.cp > 1, best.describe()  # the model itself is cut
    best = rank_configs(WIDE, tight, training, recompute=("none",))[0].config
    assert best.zero > 0 or best.tp * best.pp * best.cp > 1, best.describe()  # or its state, by ZeRO


def test_the_pipeline_bubble_is_p_minus_1_over_m_plus_p_minus_1_of_the_step():
    free_links = Cluster("8, free links", 8, 1, 1e12, 1e12, 0, 0, 0, 0)
    for micro_batches in (1, 4, 16):
        config = Config(dp=1, pp=8, micro_batch=1, micro_batches=micro_batches)
        time = predict_step_time(WIDE, free_links, Training(micro_batches), config)
        assert time["bubble"] / time["total"] == pytest.approx(7 / (micro_batches + 7))
        parts = ("compute", "tensor parallel", "context parallel", "pipeline p2p", "bubble", "data parallel")
        assert sum(time[part] for part in parts) == pytest.approx(time["total"])
        memory = activation_bytes(WIDE, free_links, Training(micro_batches), config)
        assert memory["in flight"] == min(micro_batches, 8)  # 1F1B's first stage (lesson 11)


def test_on_real_links_the_step_is_the_sum_of_its_parts():
    training = Training(16)
    for config in enumerate_configs(WIDE, two_nodes(1e-9), training, ("none", "full"), (2, 3))[::7]:
        time = predict_step_time(WIDE, two_nodes(1e-9), training, config)
        parts = ("compute", "tensor parallel", "context parallel", "pipeline p2p", "bubble", "data parallel")
        assert sum(time[part] for part in parts) == pytest.approx(time["total"]), config.describe()


def test_a_mesh_that_does_not_cover_the_devices_fails_at_once_saying_so():
    with pytest.raises(ValueError, match=r"dp 3 x tp 1 x pp 1 x cp 1 = 3 devices, but 2 x 4 has 8"):
        predict_memory(WIDE, two_nodes(1e-9), Training(3), Config(dp=3, micro_batch=1))
    with pytest.raises(ValueError, match="tp 3 does not divide the heads 16"):
        predict_step_time(WIDE, Cluster("3", 3, 1, 1e9, 1e12, 0, 0, 0, 0), Training(1), Config(tp=3))


def test_a_model_that_fits_nowhere_fails_with_the_smallest_memory_found_and_the_limit():
    with pytest.raises(ValueError, match=r"fits no configuration .* smallest memory per device found is .* limit of"):
        rank_configs(WIDE, two_nodes(1e-9, memory_bytes=1e3), Training(8))


def test_shapes_that_allow_no_mesh_fail_with_the_reason():
    odd = Model("odd", layers=3, hidden=3, heads=3, vocab=8, seq=3)
    with pytest.raises(ValueError, match="no mesh of 8 devices fits odd's shapes"):
        rank_configs(odd, two_nodes(1e-9), Training(3))
    with pytest.raises(ValueError, match="precision"):
        predict_memory(WIDE, ONE_CPU, Training(1, precision="fp8"), Config())


def test_the_presets_have_their_published_sizes():
    # exact: the paper's vocabulary of 128,000 instead of the released tokenizer's 128,256 would still pass a 1% check
    assert MODELS["llama3-405b"].num_parameters() == 405_853_388_800
    assert MODELS["llama3-8b"].num_parameters() == 8_030_261_248


def test_the_plan_script_prints_the_ranked_table_and_the_published_run_beside_it(capsys):
    plan = load_script(REPO / "scripts" / "plan.py")
    options = dict(global_batch=None, precision="mixed", top=3, every_stage=False)
    plan.main(Namespace(model="llama3-8b", cluster="h100x8", **options))
    printed = capsys.readouterr().out
    assert "step 1, fit memory" in printed and "5,762 tokens/s per GPU" in printed
    assert printed.count("(does not fit)") == 2  # the published degrees without and with selective recomputation
    assert "What this prediction ignores" in printed


def test_a_cluster_measured_on_cpu_shares_the_cores_and_its_two_rank_ring_gives_back_the_fitted_all_reduce():
    intra = {"alpha_s": 2e-4, "beta_s_per_byte": 1e-9}
    inter = {"alpha_s": 6e-4, "beta_s_per_byte": 1e-8}
    cluster = measured_cluster("2 x 2 on 2 cores", 2, 2, 1e9, 4e10, intra, inter, cores=2)
    assert cluster.flops == 2e10  # 4 processes on 2 cores: half a core each
    assert measured_cluster("1 on 2 cores", 1, 1, 1e9, 4e10, intra, intra, cores=2).flops == 4e10  # never above 1
    assert measured_cluster("2 x 2", 2, 2, 1e9, 4e10, intra, inter, cores=2, share=0.3).flops == 1.2e10  # measured
    n = 1 << 20
    two_rank = ring_seconds("all_reduce", n, 2, cluster.intra_alpha, cluster.intra_beta)
    assert two_rank == pytest.approx(intra["alpha_s"] + intra["beta_s_per_byte"] * n)
    # between nodes, each of a node's 2 devices gets half the link
    across = ring_seconds("all_reduce", n, 2, cluster.inter_alpha, cluster.inter_beta)
    assert across == pytest.approx(inter["alpha_s"] + 2 * inter["beta_s_per_byte"] * n)
    assert cluster.mask_bytes is None


checker = load_script(REPO / "benchmarks" / "planner_check.py")


def test_every_configuration_the_check_runs_is_one_the_planner_prices_with_the_same_global_batch():
    args = checker.parse_args([])
    cluster = measured_cluster("2 x 2", 2, 2, 1e12, 3e10, {"alpha_s": 4e-4, "beta_s_per_byte": 8e-10},
                               {"alpha_s": 4e-4, "beta_s_per_byte": 8e-9}, cores=2)  # fmt: skip
    assert len(checker.CONFIGS) >= 6
    for name, (pp, dp, replicas, tp, _) in checker.CONFIGS.items():
        assert pp * dp * tp == 4 and dp % replicas == 0, name
        predicted = checker.predict(args, cluster, name)
        assert predicted["time"]["total"] > 0 and predicted["memory"]["total"] > 0, name
    # priced as the composition runs them: ZeRO-3, GPipe (all 4 micro-batches held), HSDP's replicas
    # (GPipe: 4 micro-batches of 2 sequences hold what 2 of 4 hold, as measured; 1F1B would hold 2 of 2)
    gpipe = [checker.predict(args, cluster, name)["memory"]["activations"] for name in ("pp2-dp2-m2", "pp2-dp2-m4")]
    assert gpipe[0] == gpipe[1]
    hsdp, fsdp = (checker.predict(args, cluster, name)["memory"]["optimizer"] for name in ("hsdp", "fsdp"))
    assert hsdp == pytest.approx(2 * fsdp)
    # what is still not priced says why: DTensor's dispatch, the FSDP copies, the prefetched blocks
    assert any("DTensor" in reason for reason in checker.reasons("tp4", -0.5, 0.0))
    assert any("copies" in reason for reason in checker.reasons("fsdp", -0.5, 0.0))
    assert any("prefetch" in reason for reason in checker.reasons("fsdp", 0.0, 0.3))
    assert checker.reasons("fsdp", 0.2, -0.2) == []


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_the_planner_check_measures_the_machine_then_sets_1d_fsdp_on_two_nodes_beside_its_prediction(tmp_path):
    path = tmp_path / "check.json"
    command = [PYTHON, "benchmarks/planner_check.py", "--configs", "fsdp", "--steps", "3", "--json", str(path)]
    printed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=220, check=True).stdout
    assert "compute, one process, one thread" in printed and "inter-node (1gbit)" in printed
    (row,) = json.loads(path.read_text())["rows"]
    assert row["config"] == "fsdp" and row["measured_seconds"] > 0 and row["measured_bytes"] > 0
    # AdamW's states on the fullest rank: the planner's quarter, but for FSDP's uneven rows (dim 0 cut in 4)
    assert row["measured_memory"]["optimizer"] == pytest.approx(row["predicted_memory"]["optimizer"], rel=0.05)
    # the collectives counted on the busiest rank are the planner's: 5 FSDP units, 9 all-gathers, 5 reduce-scatters
    assert row["measured_calls"] == row["predicted_calls"]["total"] == 14


# The composition's GPT (benchmarks/planner_check.py's).
COMPOSITION_GPT = gpt_model(256, 64, 128, 4, 4)
CHECK = REPO / "results" / "cpu-amd-epyc-2core" / "planner_check.json"


def test_the_collective_calls_per_step_are_those_the_planner_check_counted_with_comm_debug_mode():
    # the committed run's counts (CommDebugMode on every rank, the busiest kept): collectives, pipeline sends left out
    rows = json.loads(CHECK.read_text())["rows"]
    assert len(rows) == len(checker.CONFIGS)
    for row in rows:
        pp, dp, replicas, tp, m = checker.CONFIGS[row["config"]]
        config = Config(dp=dp, tp=tp, pp=pp, micro_batch=16 // dp // m, micro_batches=m, zero=3, replicas=replicas)
        calls = collective_calls(COMPOSITION_GPT, config)
        assert calls["total"] - calls["pipeline p2p"] == row["measured_calls"], row["config"]
    assert collective_calls(COMPOSITION_GPT, Config(dp=4, micro_batch=4, zero=0))["data parallel"] == 5  # all-reduces
    # the ring (common.context_parallel.ring_messages): per block and micro-batch cp - 1 steps forward, 2 cp - 1 back
    assert collective_calls(WIDE, Config(cp=4, micro_batch=1))["context parallel"] == 8 * (3 + 7)
    # a middle pipeline stage receives and sends in both directions: 4 calls per micro-batch, an end stage 2
    assert collective_calls(WIDE, Config(pp=4, micro_batch=1, micro_batches=2))["pipeline p2p"] == 4 * 2
    assert collective_calls(WIDE, Config(pp=2, micro_batch=1, micro_batches=2))["pipeline p2p"] == 2 * 2


def test_without_a_pipeline_fsdp2_gathers_twice_and_reduce_scatters_in_every_micro_batch():
    # gradient accumulation under FSDP2's defaults: no schedule turns resharding and gradient sync off
    fsdp = [collective_calls(COMPOSITION_GPT, Config(dp=4, micro_batch=4 // m, micro_batches=m, zero=3))
            for m in (1, 2)]  # fmt: skip
    assert fsdp[0]["data parallel"] == 4 * 2 + 1 + 5  # 4 blocks gathered in forward and backward, the root once
    assert fsdp[1]["data parallel"] == 2 * fsdp[0]["data parallel"]
    piped = collective_calls(COMPOSITION_GPT, Config(dp=2, pp=2, micro_batch=2, micro_batches=4, zero=3))
    assert piped["data parallel"] == 2 * (4 + 1) + 1 + 3  # the schedule: 4 forwards' gathers and one backward's


def test_each_collective_call_adds_the_clusters_call_overhead_to_the_step():
    training, overhead = Training(16, precision="fp32"), 1e-3
    for config in (Config(dp=2, tp=2, micro_batch=8, zero=3), Config(dp=4, micro_batch=4, zero=3, replicas=2)):
        cluster = Cluster("2 x 2", 2, 2, 1e12, 1e10, 1e-4, 1e-9, 2e-4, 1e-8)
        costly = Cluster("2 x 2", 2, 2, 1e12, 1e10, 1e-4, 1e-9, 2e-4, 1e-8, call_overhead=overhead)
        before = predict_step_time(COMPOSITION_GPT, cluster, training, config)["total"]
        after = predict_step_time(COMPOSITION_GPT, costly, training, config)["total"]
        assert after - before == pytest.approx(overhead * collective_calls(COMPOSITION_GPT, config)["total"])


def test_fsdp_gathers_each_block_in_every_micro_batchs_forward_and_once_in_backward():
    free = Cluster("4, bytes only", 4, 1, 1e12, 1e12, 0, 1e-9, 0, 1e-9)
    training, layer = Training(16, precision="fp32"), COMPOSITION_GPT.layer_parameters()
    times = {m: predict_step_time(COMPOSITION_GPT, free, training, Config(dp=2, pp=2, micro_batch=8 // m,
                                  micro_batches=m, zero=3))["data parallel"] for m in (1, 4)}  # fmt: skip
    # 3 more gathers of each of the stage's 2 blocks, 4 bytes a parameter, over 2 ranks: one ring step of half
    assert times[4] - times[1] == pytest.approx(3 * 2 * layer * 4 / 2 * 1e-9)


def test_gpipe_holds_every_micro_batch_and_1f1b_at_most_p():
    training = Training(8)
    for schedule, held in (("1f1b", 2), ("gpipe", 8)):
        config = Config(dp=1, tp=1, pp=2, cp=4, micro_batch=1, micro_batches=8, schedule=schedule)
        assert activation_bytes(WIDE, two_nodes(1e-9), training, config)["in flight"] == held
    with pytest.raises(ValueError, match="schedule must be one of"):
        predict_memory(WIDE, two_nodes(1e-9), training, Config(dp=8, micro_batch=1, schedule="zb"))


def test_hsdp_shards_inside_a_replica_and_all_reduces_across_replicas():
    cluster, training = two_nodes(1e-9), Training(8)
    fsdp, hsdp = Config(dp=8, micro_batch=1, zero=3), Config(dp=8, micro_batch=1, zero=3, replicas=2)
    assert hsdp.shard_group == 4 and link(cluster, hsdp, ("dp_shard", "cp"))[2] == "intra"  # one node each
    assert link(cluster, hsdp, ("dp_replicate",))[2] == "inter" and link(cluster, fsdp, ("dp",))[2] == "inter"
    memory = {c.replicas: predict_memory(WIDE, cluster, training, c) for c in (fsdp, hsdp)}
    assert memory[2]["optimizer"] == pytest.approx(2 * memory[1]["optimizer"])
    assert sharded_parameters(WIDE, hsdp) == device_parameters(WIDE, hsdp) / 4
    with pytest.raises(ValueError, match="3 HSDP replicas do not divide dp 8"):
        predict_memory(WIDE, cluster, training, Config(dp=8, micro_batch=1, zero=3, replicas=3))
    with pytest.raises(ValueError, match="HSDP replicas are FSDP's"):
        predict_memory(WIDE, cluster, training, Config(dp=8, micro_batch=1, zero=2, replicas=2))


def counted_fsdp_calls(env):
    """One step of the composition (``common.parallelize``) on 2 stages x 2 data ranks, 4 micro-batches: the FSDP
    collectives this rank starts (``common.collectives.count_collectives``)."""
    import torch

    from common.collectives import count_collectives
    from common.gpt import GPT
    from common.parallelize import forward_backward, make_mesh, make_schedule, parallelize

    torch.manual_seed(0)
    mesh = make_mesh("cpu", 2, 2, 1, env.world_size)
    model, _ = parallelize(GPT(256, 16, 16, 2, 4, 0.0), mesh)
    schedule = make_schedule(model, mesh, 4, env.device)
    tokens = torch.randint(0, 256, (8, 17))
    forward_backward(model, schedule, mesh, tokens[:, :-1], tokens[:, 1:])  # the first step also infers shapes
    with count_collectives() as log:
        forward_backward(model, schedule, mesh, tokens[:, :-1], tokens[:, 1:])
    return {name: log.count(name) for name in ("all_gather_single", "reduce_scatter_single")}


@pytest.mark.slow  # 14 s on 2 cores: 4 processes
@pytest.mark.timeout(90)
def test_fsdp_under_the_pipeline_makes_the_calls_the_planner_counts():
    config = Config(dp=2, pp=2, micro_batch=2, micro_batches=4, zero=3)
    predicted = collective_calls(gpt_model(256, 16, 16, 2, 4), config)["data parallel"]
    for counted in run_on_ranks(counted_fsdp_calls, 4, timeout=80):
        # each stage: 2 blocks gathered in 4 forwards and 1 backward, its root once; 3 units reduce-scattered once
        assert counted == {"all_gather_single": 2 * 5 + 1, "reduce_scatter_single": 3}
        assert sum(counted.values()) == predicted


# The live counts: a small GPT on 4 processes (context 16, width 16, 2 heads, 4 blocks, 8 sequences per step).
LIVE_GPT = gpt_model(256, 16, 16, 2, 4)
LIVE_BATCH = 8


def counted_calls(env, meshes: list[tuple]) -> list[dict]:
    """For each mesh ``(pp, dp, cp, tp, micro-batches)`` of the composition (``common.parallelize``): one step to
    warm up (the schedule infers its shapes), then one step counted on this rank: the collectives by torch's
    ``CommDebugMode`` (FSDP's, DTensor's, the loss's), the point-to-point sends and receives by
    ``common.collectives.count_messages`` (the pipeline's and the ring's). Without a pipeline the micro-batches run
    as plain gradient accumulation, under FSDP2's defaults."""
    from torch.distributed.tensor.debug import CommDebugMode

    from common.collectives import count_messages
    from common.parallelize import context_share, data_rank, forward_backward, make_mesh, make_schedule, parallelize

    found = []
    for pp, dp, cp, tp, m in meshes:
        mesh = make_mesh("cpu", pp, dp, tp, env.world_size, cp=cp)
        torch.manual_seed(0)
        model, _ = parallelize(GPT(256, LIVE_GPT.seq, LIVE_GPT.hidden, LIVE_GPT.heads, LIVE_GPT.layers, 0.0), mesh)
        schedule = make_schedule(model, mesh, m, env.device)
        index, share = data_rank(mesh)[0], LIVE_BATCH // dp
        rows = torch.randint(0, 256, (LIVE_BATCH, LIVE_GPT.seq + 1))[index * share : (index + 1) * share]
        tokens, targets = (context_share(t, mesh) for t in (rows[:, :-1], rows[:, 1:]))

        def step():
            if schedule is not None:
                return forward_backward(model, schedule, mesh, tokens, targets)
            for part in zip(tokens.chunk(m), targets.chunk(m)):  # gradient accumulation: FSDP2 as it comes
                forward_backward(model, None, mesh, *part)

        step()
        with CommDebugMode() as comm, count_messages() as sent:
            step()
        found.append({"collectives": comm.get_total_counts(), "sends": sent.sends, "receives": sent.receives})
    return found


def assert_counted_as_planned(ranks: list[list[dict]], meshes: list[tuple]) -> None:
    """Each mesh's busiest rank counted what ``collective_calls`` predicts: the collectives (tensor and data
    parallel), the ring's steps (a send and a receive each) and the pipeline's sends and receives."""
    for number, (pp, dp, cp, tp, m) in enumerate(meshes):
        config = Config(dp=dp, tp=tp, pp=pp, cp=cp, micro_batch=LIVE_BATCH // dp // m, micro_batches=m, zero=3)
        planned = collective_calls(LIVE_GPT, config)
        counted = [rank[number] for rank in ranks]
        name = config.describe()
        assert max(c["collectives"] for c in counted) == planned["tensor parallel"] + planned["data parallel"], name
        messages = max(c["sends"] + c["receives"] for c in counted)
        assert messages == 2 * planned["context parallel"] + planned["pipeline p2p"], name
        if cp > 1:
            assert planned["context parallel"] == LIVE_GPT.layers * (3 * cp - 2) * m > 0  # the ring's steps


FAST_MESH = [(1, 1, 2, 2, 1)]  # cp 2 x tp 2: DTensor's collectives, FSDP over the cp ranks, the ring's steps
SLOW_MESHES = [
    (1, 4, 1, 1, 2),  # FSDP with 2 micro-batches of gradient accumulation: gathers twice, reduce-scatters twice
    (2, 2, 1, 1, 2),  # pp 2 x dp 2: the schedule keeps FSDP's blocks gathered; each stage 2 transfers a micro-batch
    (4, 1, 1, 1, 2),  # pp 4: a middle stage receives and sends both ways, 4 transfers a micro-batch
    (1, 2, 2, 1, 2),  # dp 2 x cp 2 with accumulation: the ring in every micro-batch, FSDP over dp x cp
]


@pytest.mark.timeout(90)
def test_the_planners_calls_are_what_torch_counts_on_a_context_parallel_mesh():
    ranks = run_on_ranks(counted_calls, 4, FAST_MESH, timeout=80)
    assert_counted_as_planned(ranks, FAST_MESH)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_planners_calls_are_what_torch_counts_under_pipelines_and_gradient_accumulation():
    ranks = run_on_ranks(counted_calls, 4, SLOW_MESHES, timeout=170)
    assert_counted_as_planned(ranks, SLOW_MESHES)
