"""ZeRO model-state memory against DeepSpeed's own estimators, ``estimate_zero2_model_states_mem_
needs`` (deepspeed/runtime/zero/stage_1_and_2.py) and ``estimate_zero3_model_states_mem_needs``
(stage3.py), over a grid of sizes, stages, offload options, GPUs per node and nodes.

DeepSpeed runs in a child process: its import loads some 500 modules and sets up its logging and
accelerator, none of which the other tests should share. Each deliberate difference has its own
test below, comparing with the DeepSpeed figure it replaces."""

import importlib.util
import itertools
import json
import subprocess
import sys

import pytest

from minitrain.accounting.memory import zero_memory
from minitrain.errors import UserError

PARAMS = [1_000_000, 6_738_415_616, 175_000_000_000]  # a toy, Llama 2 7B, GPT-3
LAYER_FRACTIONS = [0.0, 0.002, 0.25]  # largest layer / params
GPUS_PER_NODE = [1, 2, 8]
NODES = [1, 2, 16]
BUFFERS = [1.0, 1.5]
STAGE_3_OFFLOADS = [(False, False), (True, False), (True, True)]  # (optimizer, params)

ZERO2 = [(n, g, nodes, offload, b) for n, g, nodes, offload, b in itertools.product(
    PARAMS, GPUS_PER_NODE, NODES, (False, True), BUFFERS)]
ZERO3 = [(n, int(f * n), g, nodes, opt, par, init, b)
         for n, f, g, nodes, (opt, par), init, b in itertools.product(
             PARAMS, LAYER_FRACTIONS, GPUS_PER_NODE, NODES, STAGE_3_OFFLOADS, (True, False),
             BUFFERS)]

_DEEPSPEED = """
import json, sys
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as zero2
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as zero3
calls = json.load(sys.stdin)
print(json.dumps({"zero2": [zero2(*args) for args in calls["zero2"]],
                  "zero3": [zero3(*args) for args in calls["zero3"]]}))
"""


@pytest.fixture(scope="module")
def deepspeed():
    """DeepSpeed's (cpu, gpu[, largest layer]) bytes for each call in ZERO2 and ZERO3 and a few
    more, keyed by ("zero2" | "zero3", args)."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.fail("deepspeed is the reference these tests compare with and is not installed; "
                    "install the test extras: pip install -e '.[test]'", pytrace=False)
    # DeepSpeed's stage-3 rule for a stage-2 offload on several nodes (see the test below)
    zero3 = ZERO3 + [(n, 0, g, nodes, True, False, False, b) for n, g, nodes, _, b in ZERO2]
    calls = {"zero2": ZERO2, "zero3": zero3}
    run = subprocess.run([sys.executable, "-c", _DEEPSPEED], input=json.dumps(calls),
                         capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    return {(name, args): tuple(result)
            for name in calls for args, result in zip(calls[name], figures[name], strict=True)}


def close(ours: float, theirs: float) -> bool:
    """Equal up to DeepSpeed's ``int()`` of each figure."""
    return abs(ours - theirs) <= max(2.0, 1e-9 * abs(theirs))


def test_stage_2_matches_deepspeed(deepspeed):
    compared = 0
    for n, g, nodes, offload, b in ZERO2:
        cpu, gpu = deepspeed["zero2", (n, g, nodes, offload, b)]
        ours = zero_memory(n, zero_stage=2, gpus_per_node=g, nodes=nodes,
                           offload_optimizer=offload, buffer_factor=b)
        assert close(ours.gpu, gpu), (n, g, nodes, offload, b, ours, gpu)
        assert ours.gathered == 0
        if offload and nodes > 1:
            continue  # a deliberate difference: see the next test
        assert close(ours.cpu, cpu), (n, g, nodes, offload, b, ours, cpu)
        compared += 1
    assert compared == len(PARAMS) * len(GPUS_PER_NODE) * len(BUFFERS) * (len(NODES) + 1)


def test_stage_2_offload_on_several_nodes_counts_each_nodes_share(deepspeed):
    # DeepSpeed's stage-2 estimator puts max(4·all GPUs, 16)·Ψ on the CPU of every node; each
    # process keeps 1/(all GPUs) of the offloaded fp32 state, and a node's processes load the
    # model once each, so a node holds max(4·its GPUs, 16/nodes)·Ψ: its stage-3 estimator's rule
    # for an optimizer offload without zero.Init.
    for n, g, nodes, offload, b in ZERO2:
        if not (offload and nodes > 1):
            continue
        ours = zero_memory(n, zero_stage=2, gpus_per_node=g, nodes=nodes, offload_optimizer=True,
                           buffer_factor=b)
        stage_3_rule = deepspeed["zero3", (n, 0, g, nodes, True, False, False, b)][0]
        assert close(ours.cpu, stage_3_rule), (n, g, nodes, b, ours)
        assert ours.cpu < deepspeed["zero2", (n, g, nodes, True, b)][0]


def zero3_ours(n, largest, g, nodes, opt, par, init, b):
    return zero_memory(n, largest_layer=largest, zero_stage=3, gpus_per_node=g, nodes=nodes,
                       offload_optimizer=opt, offload_params=par, zero_init=init, buffer_factor=b)


def test_stage_3_matches_deepspeed(deepspeed):
    compared = 0
    for args in ZERO3:
        cpu, gpu, gathered = deepspeed["zero3", args]
        ours = zero3_ours(*args)
        assert close(ours.gpu, gpu) and close(ours.gathered, gathered), (args, ours, gpu)
        opt, init = args[4], args[6]
        if init and opt and ours.cpu > cpu:
            continue  # a deliberate difference: see the next test
        assert close(ours.cpu, cpu), (args, ours, cpu)
        compared += 1
    assert compared > 0.9 * len(ZERO3)


def test_stage_3_offload_under_zero_init_keeps_a_larger_layer_load(deepspeed):
    # With zero.Init each process still builds one layer at a time in fp32: DeepSpeed counts
    # 4·L per GPU of a node without offload and drops it with offload; it stays counted here
    # where it exceeds the offloaded share (a large layer on many GPUs per node).
    differ = 0
    for args in ZERO3:
        n, largest, g, nodes, opt, par, init, b = args
        if not (init and opt):
            continue
        cpu = deepspeed["zero3", args][0]
        ours = zero3_ours(*args).cpu
        assert close(ours, max(cpu, b * 4 * largest * g)), (args, ours, cpu)
        differ += ours > cpu + 2
    assert differ > 0  # the grid reaches the difference


def test_params_offload_alone_moves_the_16_bit_partition_to_the_cpu(deepspeed):
    # DeepSpeed's estimator ignores cpu_offload_params without cpu_offload; here the params'
    # 16-bit partition (2 bytes each) leaves the GPU for the CPU.
    for n, largest, g, nodes, opt, _, init, b in ZERO3:
        if opt:
            continue
        cpu, gpu, _ = deepspeed["zero3", (n, largest, g, nodes, False, False, init, b)]
        ours = zero3_ours(n, largest, g, nodes, False, True, init, b)
        assert close(ours.gpu, gpu - 2 * n / (g * nodes))
        assert close(ours.cpu, max(cpu, b * 2 * n / nodes))


@pytest.mark.parametrize(("optimizer", "precision", "options", "per_param", "per_layer"), [
    ("sgd", "bf16-mixed", {}, -8, 0),  # no state: Adam's two fp32 moments gone
    ("adam", "bf16-mixed", {"amsgrad": True}, 4, 0),  # a third fp32 moment
    ("adamw", "fp32", {}, 2, 4),  # 4-byte params and grads; fp32 partitions as before
    ("adamw", "bf16-pure", {}, 0, 0),  # the optimizer still steps on fp32 partitions
])
def test_other_optimizers_and_precisions_shift_deepspeeds_adam_figure(
        deepspeed, optimizer, precision, options, per_param, per_layer):
    for args in ZERO3:
        n, largest, g, nodes, opt, par, init, b = args
        if opt:
            continue
        gpu = deepspeed["zero3", args][1]
        ours = zero_memory(n, largest_layer=largest, gpus_per_node=g, nodes=nodes, zero_init=init,
                           buffer_factor=b, optimizer=optimizer, precision=precision, **options)
        assert close(ours.gpu, gpu + per_param * n / (g * nodes) + per_layer * largest), args


@pytest.mark.parametrize("offload", [False, True])
def test_stage_1_keeps_the_16_bit_grads_whole(offload):
    # stage 1 shards only the optimizer side (Rajbhandari et al. 2020, figure 1); stage 2 also
    # the 2-byte grads, which an offload copies to the CPU's fp32 partitions
    for n, g, nodes in itertools.product(PARAMS, GPUS_PER_NODE, NODES):
        one, two = (zero_memory(n, zero_stage=s, gpus_per_node=g, nodes=nodes,
                                offload_optimizer=offload) for s in (1, 2))
        sharded_grads = 0 if offload else 2 * n / (g * nodes)
        assert one.gpu - two.gpu == pytest.approx(2 * n - sharded_grads)
        assert one.cpu == two.cpu


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(zero_stage=0), "stage 0"),
    (dict(zero_stage=3), "largest_layer"),
    (dict(zero_stage=3, largest_layer=2e9), "largest_layer"),
    (dict(zero_stage=2, offload_params=True), "zero_stage=3"),
    (dict(zero_stage=2, gpus_per_node=0), "gpus_per_node"),
    (dict(zero_stage=2, nodes=-1), "nodes"),
    (dict(zero_stage=2, buffer_factor=0), "buffer_factor"),
    (dict(zero_stage=2, optimizer="sgd", amsgrad=True), "amsgrad"),
])
def test_bad_settings_say_what_to_pass(kwargs, match):
    with pytest.raises(UserError, match=match):
        zero_memory(1e9, **kwargs)
