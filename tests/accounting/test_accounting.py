"""Napkin math and the hardware registry against the chapter's and published figures."""

import dataclasses
import importlib
import json
import math
import os
import platform
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minitrain as mt
from minitrain import accounting as acc
from tests.references import TORCH_REFERENCED

DAY = 86_400


# --- the chapter's scenarios (3.1) ---------------------------------------------------------


def test_scenario_1_six_n_d():
    assert acc.training_flops(params=70e9, tokens=15e12) == pytest.approx(6.3e24, rel=1e-12)


def test_scenario_1_days_at_the_exact_peak_and_at_the_chapters_rounding():
    flops = acc.training_flops(params=70e9, tokens=15e12)
    days = acc.training_time(flops, hardware="h100", gpus=1024, mfu=0.5) / DAY
    assert days == pytest.approx(6.3e24 / (989.4e12 * 0.5 * 1024) / DAY)
    assert round(days) == 144
    rounded = acc.round_significant(acc.effective_throughput("h100", gpus=1024, mfu=0.5))
    assert rounded == 5e17
    assert round(flops / rounded / DAY) == 146


def test_scenario_2_forty_billion_params_on_eight_h100():
    assert acc.bytes_per_param("adamw", "fp32").total == 16
    largest = acc.max_params("h100", optimizer="adamw", precision="fp32", gpus=8)
    assert abs(largest - 40e9) <= 1e9
    assert largest == pytest.approx(8 * 80e9 / 16)


def test_bytes_per_param_by_optimizer_and_precision():
    fp32 = {name: acc.bytes_per_param(name, "fp32").total for name in acc.OPTIMIZER_STATES}
    assert fp32 == {"sgd": 8, "momentum": 12, "adagrad": 12, "rmsprop": 12, "adam": 16,
                    "adamw": 16, "adadelta": 16, "adamax": 16, "nadam": 16, "radam": 16,
                    "adafactor": 8, "lion": 12, "muon": 12, "schedule_free_adamw": 16,
                    "lamb": 16, "lars": 12, "adabelief": 16, "yogi": 16, "polyak_sgd": 8}
    # ZeRO paper section 3.1: mixed-precision Adam is 2 + 2 + 12 = 16 bytes per parameter.
    mixed = acc.bytes_per_param("adam", "bf16-mixed")
    assert (mixed.params, mixed.grads, mixed.optimizer_state + mixed.master_weights) == (2, 2, 12)
    assert acc.bytes_per_param("adamw", "bf16-pure").total == 8
    assert acc.bytes_per_param("adamw", "bf16").total == 16  # autocast over fp32 params


def test_zero_stages_follow_the_zero_paper_figure_1():
    # Rajbhandari et al. 2020, figure 1: 7.5B params, 64 GPUs, K = 12: 120, 31.4, 16.6, 1.9 GB.
    gb = [acc.training_memory(7.5e9, optimizer="adam", precision="bf16-mixed", gpus=64,
                              zero_stage=s).total / 1e9 for s in range(4)]
    assert gb == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.06)


@settings(deadline=None, max_examples=40)
@given(
    optimizer=st.sampled_from(sorted(acc.OPTIMIZER_STATES)),
    precision=st.sampled_from(sorted(acc.PRECISIONS)),
    gpus=st.integers(1, 4096),
)
def test_zero_sharding_never_costs_more_and_stage_3_divides_everything(optimizer, precision,
                                                                      gpus):
    per_param = acc.bytes_per_param(optimizer, precision)
    stages = [acc.training_memory(1e6, optimizer=optimizer, precision=precision, gpus=gpus,
                                  zero_stage=s).total / 1e6 for s in range(4)]
    assert stages[0] == per_param.total
    assert all(a >= b for a, b in zip(stages, stages[1:], strict=False))
    assert stages[3] == pytest.approx(per_param.total / gpus)


def test_cruncher_memory_is_the_chapters_formula():
    # 3.5.6: 4·(params + activations + grads + optimizer states), AdaGrad's one state, the
    # activations B·D·L (each layer's output, the next one's saved input).
    batch, dim, layers = 256, 1024, 8
    params = mt.tree.size(mt.models.cruncher_init(dim, layers, generator=mt.rng.generator(0)))
    assert mt.models.cruncher_param_count(dim, layers) == params == dim * dim * layers + dim
    memory = acc.training_memory(params, optimizer="adagrad",
                                 activation_bytes=4 * batch * dim * layers)
    num_gradients = num_optimizer_states = params
    assert memory.total == 4 * (params + batch * dim * layers + num_gradients
                                + num_optimizer_states)


def test_cruncher_exact_flops_drop_the_first_layers_input_gradient():
    batch, dim, layers = 256, 1024, 8
    params = mt.models.cruncher_param_count(dim, layers)
    assert acc.cruncher_flops(batch, dim, layers) == 6 * batch * params - 2 * batch * dim * dim
    assert acc.cruncher_flops(4, 16, 0) == 6 * 4 * 16 - 2 * 4 * 16  # linear regression


# --- published figures --------------------------------------------------------------------


def test_gpt3_training_flops_within_one_percent_of_reported():
    # Brown et al. 2020, table D.1: GPT-3 175B, 300B tokens, 3.14e23 FLOPs.
    params = acc.transformer_params(acc.preset("gpt3-175b"))
    assert params == pytest.approx(175e9, rel=0.01)
    assert acc.training_flops(params, 300e9) == pytest.approx(3.14e23, rel=0.01)


def test_llama3_405b_training_flops_within_one_percent_of_reported():
    # Llama 3 Herd of Models: 405B params, 15.6T tokens, 3.8e25 FLOPs.
    params = acc.transformer_params(acc.preset("llama3-405b"))
    assert params == pytest.approx(405e9, rel=0.01)
    assert acc.training_flops(params, 15.6e12) == pytest.approx(3.8e25, rel=0.01)


@pytest.mark.parametrize(
    "name, published",
    [  # parameter counts Hugging Face reports for these checkpoints
        ("gpt2", 124_439_808),
        ("gpt2-medium", 354_823_168),
        ("gpt2-large", 774_030_080),
        ("gpt2-xl", 1_557_611_200),
        ("llama3-8b", 8_030_261_248),
        ("llama3-70b", 70_553_706_496),
    ],
)
def test_preset_params_match_published_checkpoints(name, published):
    assert acc.transformer_params(acc.preset(name)) == published


def test_flops_per_token_add_the_attention_term_to_six_n():
    # PaLM appendix B: 6N + 12·L·H·Q·T.
    config = acc.preset("gpt3-175b")
    attention = 12 * config.num_layers * config.hidden * config.seq_len
    per_token = acc.transformer_flops_per_token(config)
    assert per_token == 6 * acc.transformer_matmul_params(config) + attention
    assert per_token == pytest.approx(6 * acc.transformer_params(config) + attention, rel=0.01)


def test_korthikanti_activation_formulas():
    s, b, h, a, L = 2048, 4, 12288, 96, 96
    none = acc.transformer_activation_bytes(seq_len=s, batch=b, hidden=h, heads=a, num_layers=L)
    assert none == L * s * b * h * (34 + 5 * a * s / h)  # eq. 1
    selective = acc.transformer_activation_bytes(seq_len=s, batch=b, hidden=h, heads=a,
                                                 num_layers=L, recompute="selective")
    assert selective == L * 34 * s * b * h
    full = acc.transformer_activation_bytes(seq_len=s, batch=b, hidden=h, heads=a, num_layers=L,
                                            recompute="full")
    assert full == L * 2 * s * b * h


# --- hardware -----------------------------------------------------------------------------


def test_h100_accelerator_intensity_is_about_295():
    h100 = acc.hardware("h100")
    assert h100.peak("bf16") == 989.4e12 and h100.memory_bandwidth == 3.35e12
    assert h100.intensity("bf16") == pytest.approx(295, abs=1)


def test_dense_and_sparse_peaks_are_kept_apart():
    h100 = acc.hardware("h100")
    assert h100.peak("bf16", sparse=True) == pytest.approx(1979e12, rel=1e-3)  # the whitepaper
    for name in acc.hardware_names():
        if name == "cpu":
            continue
        spec = acc.hardware(name)
        assert spec.source
        for dtype, sparse in spec.sparse_flops.items():
            assert sparse == 2 * spec.peak_flops[dtype]


def test_hardware_record_is_frozen_and_serializable():
    spec = acc.hardware("a100-80gb")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "x"
    with pytest.raises(TypeError):
        spec.peak_flops["bf16"] = 1.0
    assert json.loads(json.dumps(spec.to_dict()))["peak_flops"]["bf16"] == 312e12


@pytest.mark.parametrize(
    "device, expected",
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA A100 80GB PCIe", "a100-80gb"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA GeForce RTX 4090", None),
        ("Tesla T4", None),
    ],
)
def test_cuda_device_names_map_to_registry_entries(device, expected):
    spec = acc.hardware_for_cuda_device(device)
    assert (spec.name if spec else None) == expected


def test_cpu_is_measured_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MINITRAIN_CACHE_DIR", str(tmp_path))
    measured = acc.measure_cpu(refresh=True)
    assert measured.measured and measured.name == "cpu"
    assert measured.peak_flops["fp32"] > 1e8 and measured.peak_flops["bf16"] > 1e7
    assert measured.memory_bandwidth > 1e8 and measured.memory_bytes > 0
    assert acc.hardware("cpu") is measured  # per-process cache
    (cached_file,) = tmp_path.glob("hardware-cpu-*.json")
    monkeypatch.setattr(importlib.import_module("minitrain.accounting.hardware"), "_MEASURED", {})
    from_disk = acc.hardware("cpu")
    assert from_disk is not measured and from_disk == measured
    assert json.loads(cached_file.read_text())["name"] == "cpu"


@pytest.mark.parametrize(
    ("flags", "fp32_per_cycle", "bf16_times"),
    [({"avx512f", "avx2", "avx", "avx512_bf16"}, 64, 2), ({"avx2", "avx", "fma"}, 32, 1),
     ({"avx512f", "amx_bf16"}, 64, 32), ({"sse2"}, 16, 1), ({"asimd"}, 16, 1), (set(), 4, 1)],
)
def test_cpu_peak_bound_is_cores_fma_units_lanes_two_and_clock(flags, fp32_per_cycle, bf16_times):
    bound = acc.cpu_peak_bound(3, flags, 2.5e9)
    assert bound["fp32"] == 3 * fp32_per_cycle * 2.5e9
    assert bound["bf16"] == bound["fp32"] * bf16_times


def test_without_cpufreq_the_bound_takes_5_ghz_not_the_reported_clock(monkeypatch):
    """A VM hides cpufreq and reports its nominal clock as ``cpu MHz``, below its boost."""
    hardware = importlib.import_module("minitrain.accounting.hardware")
    real_read = hardware.Path.read_text

    def read_text(path, *args, **kwargs):
        if "cpufreq" in str(path):
            raise FileNotFoundError(path)
        return real_read(path, *args, **kwargs)

    monkeypatch.setattr(hardware.Path, "read_text", read_text)
    monkeypatch.setattr(hardware, "_cpuinfo", lambda: {"cpu MHz": "2599.998", "flags": "avx2"})
    assert hardware._spec_bound(1)["clock_hz"] == 5e9


def _best_matmul_flops(dtype: torch.dtype, n: int = 512, repeats: int = 5) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(4):  # a matmul-heavy step
            torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 4 * 2 * n**3 / best


@pytest.mark.parametrize("loaded", [False, True])
@pytest.mark.parametrize("threads", [1, None])
def test_mfu_of_a_matmul_heavy_step_is_at_most_one(tmp_path, monkeypatch, threads, loaded):
    """Per process, as data parallel runs it (one thread each under --nproc 2) and as one run;
    ``loaded``: the probe ran while the machine was busy (its matmuls timed at 1 MFLOP/s)."""
    monkeypatch.setenv("MINITRAIN_CACHE_DIR", str(tmp_path))
    if loaded:
        module = importlib.import_module("minitrain.accounting.hardware")
        monkeypatch.setattr(module, "_matmul_flops_per_second", lambda *args: 1e6)
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        spec = acc.measure_cpu()
        for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            mfu = _best_matmul_flops(dtype) / spec.peak(name)
            assert 0 < mfu <= 1, (name, mfu, spec.source)
        bound = spec.details["key"]["bound"]
        assert bound["cores"] == min(torch.get_num_threads(), len(os.sched_getaffinity(0)))
        assert spec.peak("fp32") >= bound["flops"]["fp32"] > 0
    finally:
        torch.set_num_threads(before)


# --- errors and imports -------------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda: acc.training_time(1e20, mfu=1.5),
        lambda: acc.training_time(1e20, gpus=0),
        lambda: acc.training_flops(-1, 10),
        lambda: acc.training_flops(math.inf, 10),
        lambda: acc.bytes_per_param("lambda"),
        lambda: acc.bytes_per_param("adamw", "fp7"),
        lambda: acc.max_params("h100", zero_stage=4),
        lambda: acc.preset("gpt5"),
        lambda: acc.hardware("tpu"),
        lambda: acc.hardware("h100").peak("fp4"),
        lambda: acc.transformer_activation_bytes(seq_len=1, batch=1, hidden=1, heads=1,
                                                 num_layers=1, recompute="some"),
    ],
)
def test_bad_input_is_a_value_error_saying_what_to_do(call):
    with pytest.raises(ValueError, match="must|choose|unknown|no|leaves"):
        call()


def test_napkin_math_and_estimate_cli_import_without_torch():
    code = (
        "import sys, minitrain as mt\n"
        "mt.accounting.training_time(mt.accounting.training_flops(70e9, 15e12), 'h100', 1024)\n"
        "mt.accounting.max_params('h100', gpus=8)\n"
        "mt.accounting.transformer_memory(mt.accounting.preset('gpt2'), batch=1)\n"
        "from minitrain.cli import cli\n"
        "cli.main(['estimate', 'time', '--params', '7e10', '--tokens', '1.5e13'],"
        " standalone_mode=False)\n"
        "cli.main(['estimate', 'memory'], standalone_mode=False)\n"
        "cli.main(['hardware', 'h100'], standalone_mode=False)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# --- the CPU measurement's cache: same machine, same torch build, at most a week old -----------


@pytest.fixture
def quick_cpu(tmp_path, monkeypatch):
    """The hardware module with a small, fast measurement and an empty cache in ``tmp_path``."""
    module = importlib.import_module("minitrain.accounting.hardware")
    monkeypatch.setenv("MINITRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(module, "_MATMUL_SIZE", {"fp32": 64, "bf16": 64, "fp16": 64})
    monkeypatch.setattr(module, "_COPY_BYTES", 2**20)
    monkeypatch.setattr(module, "_MEASURED", {})
    return module


def test_cpu_cache_records_when_and_where_it_was_measured(quick_cpu, tmp_path):
    import torch

    before = time.time()
    spec = quick_cpu.measure_cpu()
    details = spec.details
    assert before <= details["measured_unix"] <= time.time()
    assert details["measured_at"] in spec.source and "UTC" in details["measured_at"]
    assert details["key"]["torch"] == torch.__version__
    assert details["key"]["torch_git"] == torch.version.git_version
    assert details["key"]["cpu"] == quick_cpu._cpu_model()
    assert details["key"]["host"] == platform.node()
    (path,) = tmp_path.glob("hardware-cpu-*.json")
    assert json.loads(path.read_text())["details"] == json.loads(json.dumps(dict(details)))


def test_cpu_refresh_measures_again_and_rewrites_the_cache(quick_cpu, tmp_path):
    first = quick_cpu.measure_cpu()
    assert quick_cpu.measure_cpu() is first  # per-process cache
    again = quick_cpu.measure_cpu(refresh=True)
    assert again is not first
    assert again.details["measured_unix"] > first.details["measured_unix"]
    assert quick_cpu.measure_cpu() is again
    (path,) = tmp_path.glob("hardware-cpu-*.json")
    assert json.loads(path.read_text())["details"]["measured_unix"] == again.details[
        "measured_unix"]


def rewrite_cached(path, **details):
    record = json.loads(path.read_text())
    record["details"].update(details)
    path.write_text(json.dumps(record))
    return record


def test_cpu_cache_expires(quick_cpu, tmp_path, monkeypatch):
    first = quick_cpu.measure_cpu()
    (path,) = tmp_path.glob("hardware-cpu-*.json")
    monkeypatch.setattr(quick_cpu, "_MEASURED", {})
    week_old = first.details["measured_unix"] - quick_cpu.MAX_AGE_SECONDS + 60
    rewrite_cached(path, measured_unix=week_old)
    assert quick_cpu.measure_cpu().details["measured_unix"] == week_old  # not yet expired
    monkeypatch.setattr(quick_cpu, "_MEASURED", {})
    rewrite_cached(path, measured_unix=week_old - 120)
    assert quick_cpu.measure_cpu().details["measured_unix"] > first.details["measured_unix"]


def test_cpu_cache_from_a_probe_without_fp16_is_measured_again(quick_cpu, tmp_path, monkeypatch):
    first = quick_cpu.measure_cpu()
    assert set(first.peak_flops) == {"fp32", "bf16", "fp16"}
    (path,) = tmp_path.glob("hardware-cpu-*.json")
    record = json.loads(path.read_text())
    del record["peak_flops"]["fp16"]
    path.write_text(json.dumps(record))
    monkeypatch.setattr(quick_cpu, "_MEASURED", {})
    again = quick_cpu.measure_cpu()
    assert again.details["measured_unix"] > first.details["measured_unix"]
    assert again.peak_flops["fp16"] > 0


@pytest.mark.parametrize("field, other", [("torch", "1.0.0"), ("cpu", "Another CPU"),
                                          ("host", "another-host"), ("torch_git", "0" * 40)])
def test_cpu_cache_from_another_machine_or_torch_build_is_not_reused(quick_cpu, tmp_path,
                                                                     monkeypatch, field, other):
    first = quick_cpu.measure_cpu()
    (path,) = tmp_path.glob("hardware-cpu-*.json")
    rewrite_cached(path, key={**first.details["key"], field: other})
    monkeypatch.setattr(quick_cpu, "_MEASURED", {})
    fresh = quick_cpu.measure_cpu()
    assert fresh.details["key"] == first.details["key"]
    assert fresh.details["measured_unix"] > first.details["measured_unix"]


def test_cpu_measured_elsewhere_lands_in_another_cache_file(quick_cpu, tmp_path, monkeypatch):
    quick_cpu.measure_cpu()
    monkeypatch.setattr(quick_cpu, "_cpu_model", lambda: "Another CPU")
    other = quick_cpu.measure_cpu()
    assert other.details["key"]["cpu"] == "Another CPU"
    assert len(list(tmp_path.glob("hardware-cpu-*.json"))) == 2


def test_cpu_cache_of_an_older_layout_is_measured_again(quick_cpu, tmp_path, monkeypatch):
    first = quick_cpu.measure_cpu()
    (path,) = tmp_path.glob("hardware-cpu-*.json")
    record = json.loads(path.read_text())
    del record["details"]["measured_unix"]
    path.write_text(json.dumps(record))
    monkeypatch.setattr(quick_cpu, "_MEASURED", {})
    assert quick_cpu.measure_cpu().details["measured_unix"] > first.details["measured_unix"]


def test_hardware_cpu_measure_from_the_shell(quick_cpu, capsys):
    from minitrain.cli import main

    first = quick_cpu.measure_cpu()
    with pytest.raises(SystemExit) as exit_info:
        main(["hardware", "cpu", "--measure", "--json"])
    assert exit_info.value.code == 0
    record = json.loads(capsys.readouterr().out)
    assert record["details"]["measured_unix"] > first.details["measured_unix"]
    assert record["details"]["measured_at"] in record["source"]
    with pytest.raises(SystemExit) as exit_info:
        main(["hardware", "h100", "--measure"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "minitrain hardware cpu --measure" in err
    assert len(err.strip().splitlines()) == 1


def test_hardware_table_gives_cpu_figures_with_their_own_prefix(quick_cpu, capsys):
    from minitrain.cli import main

    spec = quick_cpu.measure_cpu()
    with pytest.raises(SystemExit) as exit_info:
        main(["hardware", "cpu"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    row = next(line for line in out.splitlines() if line.startswith("cpu "))
    fp32 = spec.peak("fp32")
    prefix, scale = next((p, s) for p, s in (("T", 1e12), ("G", 1e9), ("M", 1e6)) if fp32 >= s)
    assert f"{fp32 / scale:.4g} {prefix}" in row
    assert spec.details["measured_at"] in out
    with pytest.raises(SystemExit):
        main(["hardware", "h100"])
    assert "989.4 T" in capsys.readouterr().out


# --- optimizer state layouts against torch.optim -------------------------------------------------


def _torch_optimizers():
    import lion_pytorch
    import schedulefree
    import torch

    o = torch.optim
    return {
        "sgd": (o.SGD, {}), "momentum": (o.SGD, dict(momentum=0.9)), "adagrad": (o.Adagrad, {}),
        "rmsprop": (o.RMSprop, {}), "adam": (o.Adam, {}), "adamw": (o.AdamW, {}),
        "adadelta": (o.Adadelta, {}), "adamax": (o.Adamax, {}), "nadam": (o.NAdam, {}),
        "radam": (o.RAdam, {}), "adafactor": (o.Adafactor, {}), "lion": (lion_pytorch.Lion, {}),
        "muon": (o.Muon, {}), "schedule_free_adamw": (schedulefree.AdamWScheduleFree, {}),
    }


@pytest.mark.parametrize(
    ("optimizer", "shape"),
    [(name, shape) for name in TORCH_REFERENCED for shape in [(7,), (4, 6), (3, 4, 5)]
     if name != "muon" or len(shape) == 2],  # torch's Muon takes matrices only
)
def test_optimizer_state_elements_equal_torchs_state(optimizer, shape):
    import torch

    cls, options = _torch_optimizers()[optimizer]
    p = torch.nn.Parameter(torch.randn(shape))
    p.grad = torch.randn(shape)
    opt = cls([p], **options)
    if hasattr(opt, "train"):  # schedulefree steps in train mode only
        opt.train()
    opt.step()
    elements = sum(t.numel() for t in opt.state[p].values() if isinstance(t, torch.Tensor))
    assert acc.optimizer_state_elements(optimizer, shape) == elements


@pytest.mark.parametrize(
    ("optimizer", "cls", "options", "extra"),
    [("adam", "Adam", dict(amsgrad=True), dict(amsgrad=True)),
     ("rmsprop", "RMSprop", dict(momentum=0.9, centered=True), dict(momentum=True, centered=True))],
)
def test_optimizer_state_elements_with_options(optimizer, cls, options, extra):
    import torch

    p = torch.nn.Parameter(torch.randn(4, 6))
    p.grad = torch.randn(4, 6)
    opt = getattr(torch.optim, cls)([p], **options)
    opt.step()
    elements = sum(t.numel() for t in opt.state[p].values())
    assert acc.optimizer_state_elements(optimizer, (4, 6), **extra) == elements


def test_optimizer_state_elements_bad_input():
    with pytest.raises(ValueError, match="choose one of"):
        acc.optimizer_state_elements("lambda", (3,))
    with pytest.raises(ValueError, match="sizes >= 0"):
        acc.optimizer_state_elements("adam", (3, -1))
