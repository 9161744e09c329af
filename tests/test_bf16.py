"""bfloat16 on the CPU: the matrix-vector kernel of ``ops.linear``, eager decoding with bfloat16
weights, and mixed-precision training (``--amp bf16``).

Oracles: float64 (the same computation in double precision) and the plain PyTorch version run
in bfloat16; the kernel's error against float64 is at most twice that of plain PyTorch. Paths
that refuse where bfloat16 is not native are tested with the detection monkeypatched, both ways,
so the suite runs (and tests correctness on tiny shapes) on any CPU.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from transformer_ext import cpu_features, ops, reference
from transformer_ext import train as train_mod
from transformer_ext.checkpoint import load_model
from transformer_ext.demo import DEMO_MODEL_DIR as DEMO_DIR
from transformer_ext.runtimes import CatCacheRunner, EagerRunner
from transformer_ext.training import TrainingError, TrainOptions, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (rows, in_features, out_features): 1..4 rows take the matrix-vector kernel, 5 at::linear;
# in_features with and without a tail after the vector width, out_features with a partial block.
LINEAR_SHAPES = [(1, 37, 13), (2, 64, 24), (3, 512, 40), (4, 100, 9), (5, 48, 16), (1, 16, 8000)]


def _max_err(y: torch.Tensor, want: torch.Tensor) -> float:
    return (y.double() - want).abs().max().item()


@pytest.mark.parametrize("rows, k, n", LINEAR_SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_bfloat16_matches_float64(rows, k, n, with_bias):
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if with_bias else None
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    with torch.inference_mode():
        y = ops.linear(x, w, b)
        plain = F.linear(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    err, plain_err = _max_err(y, want), _max_err(plain, want)
    assert plain_err > 0  # the bfloat16 output rounding is always there
    assert err <= 2 * plain_err, (err, plain_err)


def test_linear_bfloat16_keeps_leading_dimensions():
    x = torch.randn(2, 1, 40).bfloat16()
    w = torch.randn(24, 40).bfloat16()
    with torch.inference_mode():
        y = ops.linear(x, w)
    want = F.linear(x.double(), w.double())
    assert y.shape == (2, 1, 24)
    assert _max_err(y, want) <= 2 * _max_err(F.linear(x, w), want)


def test_linear_bfloat16_strided_and_one_dimensional_inputs():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 64, generator=g).bfloat16()
    b = torch.randn(40, generator=g).bfloat16()
    for x in (torch.randn(64, generator=g).bfloat16(), torch.randn(64, 3, generator=g).bfloat16().t()):
        want = F.linear(x.double(), w.double(), b.double())
        with torch.inference_mode():
            y = ops.linear(x, w, b)
        assert y.shape == want.shape
        assert _max_err(y, want) <= 2 * _max_err(F.linear(x, w, b), want)


def test_linear_bfloat16_widening_kernel_without_the_dot_product_instruction():
    """TRANSFORMER_EXT_CPU_BF16_DOT=0: the kernels that widen bfloat16 to float32 (what a CPU without
    AVX-512 BF16 runs), against float64 with the same rule, in a fresh process."""
    code = (
        "import torch, torch.nn.functional as F\n"
        "from transformer_ext import ops\n"
        "g = torch.Generator().manual_seed(1)\n"
        "for rows, k, n in [(1, 37, 13), (3, 512, 40), (4, 100, 9)]:\n"
        "    x = torch.randn(rows, k, generator=g).bfloat16(); w = torch.randn(n, k, generator=g).bfloat16()\n"
        "    b = torch.randn(n, generator=g).bfloat16()\n"
        "    want = F.linear(x.double(), w.double(), b.double())\n"
        "    with torch.inference_mode():\n"
        "        err = (ops.linear(x, w, b).double() - want).abs().max().item()\n"
        "        plain = (F.linear(x, w, b).double() - want).abs().max().item()\n"
        "    assert 0 < plain and err <= 2 * plain, (rows, k, n, err, plain)\n"
        "print('ok')\n"
    )
    env = {**os.environ, "TRANSFORMER_EXT_CPU_BF16_DOT": "0", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


# --------------------------------------------------------------------------- detection stand-ins
NATIVE = cpu_features.bf16_support(
    cpu_features.CpuFlags(
        "x86", "AMD EPYC 9R14", frozenset({"avx2", "avx512f", "avx512_bf16"}), "/proc/cpuinfo"
    )
)
NOT_NATIVE = cpu_features.bf16_support(
    cpu_features.CpuFlags("x86", "AMD EPYC 7B12", frozenset({"avx2", "fma"}), "/proc/cpuinfo")
)


@pytest.fixture
def native(monkeypatch):
    """bfloat16 counted as native whatever this CPU has (correct everywhere, slow where emulated)."""
    monkeypatch.setattr(cpu_features, "bf16_support", lambda flags=None: NATIVE)


@pytest.fixture
def not_native(monkeypatch):
    monkeypatch.setattr(cpu_features, "bf16_support", lambda flags=None: NOT_NATIVE)
    monkeypatch.setattr(
        cpu_features,
        "matmul_rates",
        lambda dtypes, **kw: {d: (171.0 if d == "float32" else 1.5) for d in dtypes},
    )


# --------------------------------------------------------------------------- attention under autocast
def _qkv(B=2, H=2, Q=5, K=7, D=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g, dtype=torch.float64).to(dtype) for T in (Q, K, K)]


def test_attention_under_autocast_runs_in_the_autocast_dtype():
    q, k, v = _qkv()
    lengths = torch.tensor([7, 4])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ops.attention(q, k, v, key_lengths=lengths, causal=True)
    assert out.dtype == torch.bfloat16
    # exactly the op on the cast inputs: the cast is the only thing autocast adds
    same = ops.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), key_lengths=lengths, causal=True)
    assert torch.equal(out, same)
    # float64 is left alone by autocast, as torch's own autocast ops leave it
    q64, k64, v64 = _qkv(dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ops.attention(q64, k64, v64).dtype == torch.float64


def test_attention_backward_under_autocast_against_float64():
    q, k, v = (t.requires_grad_() for t in _qkv(seed=1))
    lengths = torch.tensor([7, 3])
    g = torch.Generator().manual_seed(2)
    grad = torch.randn(2, 2, 5, 16, generator=g, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ops.attention(q, k, v, key_lengths=lengths)
    out.backward(grad.to(out.dtype))
    assert q.grad.dtype == torch.float32  # gradients reach the float32 inputs in float32
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = reference.attention(*leaves, key_lengths=lengths)
    want.backward(grad)
    low = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    plain = reference.attention(*low, key_lengths=lengths)  # plain PyTorch in bfloat16
    plain.backward(grad.bfloat16())
    assert _max_err(out, want) <= 2 * _max_err(plain, want)
    for ours_leaf, want_leaf, plain_leaf in zip((q, k, v), leaves, low):
        assert _max_err(ours_leaf.grad, want_leaf.grad) <= 2 * _max_err(plain_leaf.grad, want_leaf.grad)


# --------------------------------------------------------------------------- training --amp bf16
TINY = dict(
    preset="tiny",
    range_low=0,
    range_high=99,
    max_tokens=400,
    warmup=10,
    lr_factor=2.0,
    dropout=0.1,
    max_steps=24,
    eval_every=12,
    eval_examples=4,
    final_eval=False,
    progress=False,
    log_every=0,
    threads=1,
    oversample=(),
)
LOSS_RTOL = 0.03  # bfloat16 products vs float32 on the same batches: measured within 0.5% here


def _tiny(tmp_path, name, **kw) -> TrainOptions:
    return TrainOptions(out_dir=str(tmp_path / name), **{**TINY, **kw})


@pytest.fixture(scope="module")
def float32_run(tmp_path_factory):
    """The tiny run in float32, uninterrupted: the oracle of the bfloat16 runs."""
    return train(_tiny(tmp_path_factory.mktemp("f32"), "run"))


def _float_dtypes(path) -> set:
    return {t.dtype for t in load_file(str(path)).values() if t.is_floating_point()}


def test_amp_bf16_on_a_cpu_without_native_bfloat16_is_refused_before_anything_is_written(
    tmp_path, not_native
):
    with pytest.raises(TrainingError) as info:
        train(_tiny(tmp_path, "run", amp="bf16"))
    message = str(info.value)
    assert "\n" not in message and message.startswith("--amp bf16 needs")
    assert "avx512_bf16 or amx_bf16" in message and "AMD EPYC 7B12" in message
    assert "1.5 GFLOP/s vs 171.0" in message and "114x slower" in message
    assert not (tmp_path / "run").exists()


def test_amp_fp16_on_the_cpu_is_refused(tmp_path, native, capsys):
    with pytest.raises(TrainingError, match=r"^--amp fp16 is CUDA only \(measured here: .* GFLOP/s"):
        train(_tiny(tmp_path, "run", amp="fp16"))
    assert not (tmp_path / "run").exists()
    code = train_mod.main(
        ["--output-dir", str(tmp_path / "cli"), "--preset", "tiny", "--amp", "fp16", "--threads", "1"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "--amp fp16 is CUDA only" in err[0]
    assert not (tmp_path / "cli").exists()


def test_amp_bf16_trains_with_float32_weights_state_and_checkpoints(tmp_path, native, float32_run):
    result = train(_tiny(tmp_path, "run", amp="bf16"))
    assert len(result.losses) == len(float32_run.losses) == TINY["max_steps"]
    for step, (low, full) in enumerate(zip(result.losses, float32_run.losses), start=1):
        assert low == pytest.approx(full, rel=LOSS_RTOL), step
    last = tmp_path / "run" / "last"
    assert _float_dtypes(last / "model.safetensors") == {torch.float32}
    assert _float_dtypes(last / "training_state.safetensors") == {torch.float32}  # Adam moments included
    model = load_model(last)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.parametrize("first, then", [(None, "bf16"), ("bf16", None)])
def test_resume_across_precisions(tmp_path, native, float32_run, first, then):
    half = TINY["max_steps"] // 2
    train(_tiny(tmp_path, "run", amp=first, max_steps=half))
    resumed = train(_tiny(tmp_path, "run", amp=then, resume=True))
    assert resumed.first_step == half + 1 and resumed.step == TINY["max_steps"]
    for low, full in zip(resumed.losses, float32_run.losses[half:]):
        assert low == pytest.approx(full, rel=LOSS_RTOL)
    assert _float_dtypes(tmp_path / "run" / "last" / "model.safetensors") == {torch.float32}


# --------------------------------------------------------------------------- eager decode in bfloat16
@pytest.fixture(scope="module")
def demo_model():
    from transformer_ext.demo import DEMO_MODEL_DIR

    return load_model(DEMO_MODEL_DIR, "cpu")


def _teacher_forced_logits(runner, src, lengths, tokens) -> np.ndarray:
    """``[steps, rows, V]`` float64: the logits of every step with ``tokens`` fed (the same for
    every runner, so each step's error is that of one step, not of a diverging decode)."""
    state = runner.encode(src, lengths, tokens.shape[1])
    return np.stack([runner.step(state, tokens[:, t]).astype(np.float64) for t in range(tokens.shape[1])])


def test_eager_bfloat16_keeps_weights_and_caches_in_bfloat16(demo_model, native):
    runner = EagerRunner(demo_model, dtype="bfloat16")
    assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in demo_model.parameters()} == {torch.float32}  # the caller's model untouched
    state = runner.encode(np.array([[5, 6, 7, 8]]), np.array([4]), 6)
    assert state.cache.key_layers[0].dtype == torch.bfloat16 and state.cross_keys[0].dtype == torch.bfloat16
    logits = runner.step(state, np.array([demo_model.config.bos_id]))
    assert logits.dtype == np.float32 and np.isfinite(logits).all()
    assert EagerRunner(demo_model, dtype=torch.float32).model is demo_model  # already float32: no copy


def test_eager_bfloat16_logits_against_float64(demo_model, native, one_thread):
    """Per step, teacher-forced on the float64 greedy tokens: our bfloat16 logits' error against
    float64 is at most twice that of plain PyTorch in bfloat16 (CatCacheRunner on bfloat16 weights)."""
    from transformer_ext.decoding import greedy_decode

    src = np.array([[7, 8, 9, 10, 11, 12, 13], [14, 15, 16, 5, 0, 0, 0], [20, 21, 22, 23, 24, 25, 0]])
    lengths = np.array([7, 4, 6])
    exact = EagerRunner(copy.deepcopy(demo_model).double())
    c = demo_model.config
    hyps = greedy_decode(
        exact, src, lengths, bos_id=c.bos_id, eos_id=c.eos_id, max_decoding_length=8, min_decoding_length=8
    )
    tokens = np.array([[c.bos_id] + list(h[:-1]) for h in hyps])
    want = _teacher_forced_logits(exact, src, lengths, tokens)
    ours = _teacher_forced_logits(EagerRunner(demo_model, dtype="bfloat16"), src, lengths, tokens)
    plain = _teacher_forced_logits(CatCacheRunner(copy.deepcopy(demo_model).bfloat16()), src, lengths, tokens)
    err, plain_err = np.abs(ours - want).max(), np.abs(plain - want).max()
    print(f"logits max error vs float64: bfloat16 {err:.3g}, plain bfloat16 {plain_err:.3g}")
    assert 0 < plain_err and err <= 2 * plain_err, (err, plain_err)
    # and float32 is far closer than either (the test would catch a bfloat16 path left in float32)
    f32 = _teacher_forced_logits(EagerRunner(demo_model), src, lengths, tokens)
    assert np.abs(f32 - want).max() < err / 10


@pytest.fixture
def one_thread():
    """One intra-op thread: the demo model's products are too small to share, and a thread team
    on a loaded machine waits for its slowest member at every op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_eager_bfloat16_tokens_equal_float32_on_the_demo_heldout_set(demo_model, native, one_thread):
    """Greedy tokens of bfloat16 weights equal float32's on at least 99% of the demo's held-out numbers."""
    from num2words import num2words

    from transformer_ext.data import split_numbers
    from transformer_ext.translate import Translator

    sources = [num2words(n, lang="en") for n in split_numbers().heldout]
    full = Translator.from_model_dir(None).translate(sources)
    low = Translator(Translator.from_model_dir(None).tokenizer, EagerRunner(demo_model, dtype="bfloat16"))
    half = low.translate(sources)
    agree = sum(a == b for a, b in zip(full, half)) / len(sources)
    print(f"bfloat16 greedy equal to float32 on {agree:.1%} of {len(sources)} held-out numbers")
    assert len(sources) >= 400 and agree >= 0.99


def test_eager_bfloat16_refused_where_not_native(demo_model, not_native):
    with pytest.raises(cpu_features.NotNativeError) as info:
        EagerRunner(demo_model, dtype="bfloat16")
    message = str(info.value)
    assert message.startswith("dtype='bfloat16' needs") and "avx512_bf16 or amx_bf16" in message
    assert "114x slower" in message and "\n" not in message


@pytest.mark.parametrize("dtype", ["float16", "bf16", torch.float16, 3])
def test_eager_bad_dtype_is_named(demo_model, dtype):
    with pytest.raises(ValueError, match=r"dtype must be one of float32, bfloat16, got"):
        EagerRunner(demo_model, dtype=dtype)


# --------------------------------------------------------------------------- the ONNX Runtime probe
def test_probe_ort_lowp_reports_every_op_and_type():
    pytest.importorskip("onnxruntime")
    from benchmarks.probes import probe_ort_lowp

    support = probe_ort_lowp.probe_support(32, 16)
    assert set(support) == {f"{op}/{t}" for op in probe_ort_lowp.OPS for t in probe_ort_lowp.TYPES}
    for op in probe_ort_lowp.OPS:
        assert support[f"{op}/float32"] == {"accepted": True, "error": None, "runs": True}
    for entry in support.values():
        assert entry["accepted"] or entry["error"]  # a refusal carries the provider's reason
    (case,) = probe_ort_lowp.time_matmuls([(32, 16)], [3], [1], repeats=1)
    assert case["relative_error_vs_float64"]["float32"] < 1e-5
    assert all(np.isfinite(v) for v in case["relative_error_vs_float64"].values())
    assert case["speedup_vs_float32"]["float32"] == 1.0


def test_probe_rounds_to_bfloat16_like_torch():
    from benchmarks.probes import probe_ort_lowp

    x = torch.randn(1000, generator=torch.Generator().manual_seed(4)) * 100
    mine = probe_ort_lowp._rounded(x.numpy(), "bfloat16")
    assert np.array_equal(mine, x.bfloat16().float().numpy())


# --------------------------------------------------------------------------- Translator and translate --dtype
def _translate_cli(argv, capsys):
    import io

    from transformer_ext.translate import main

    try:
        code = main(argv, stdin=io.StringIO(""))
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_translator_from_model_dir_in_bfloat16(native, one_thread):
    from transformer_ext.translate import Translator

    translator = Translator.from_model_dir(None, dtype="bfloat16")
    assert {p.dtype for p in translator.runner.model.parameters()} == {torch.bfloat16}
    assert translator.runner.info.precision == "bf16"
    assert translator.translate(["forty-two", "three hundred and seven"]) == [
        "zweiundvierzig",
        "dreihundertsieben",
    ]


def test_translate_cli_dtype_bfloat16(native, capsys, one_thread):
    code, out, _ = _translate_cli(["--dtype", "bfloat16", "forty-two", "one thousand and one"], capsys)
    assert code == 0 and out == "zweiundvierzig\neintausendeins\n"


def test_translate_cli_dtype_bfloat16_refused_where_not_native(not_native, capsys, tmp_path):
    out_file = tmp_path / "out.txt"
    code, out, err = _translate_cli(["--dtype", "bfloat16", "--output", str(out_file), "forty-two"], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and out == "" and len(lines) == 1
    assert "--dtype bfloat16 needs a CPU with native bfloat16" in lines[0] and "avx512_bf16" in lines[0]
    assert not out_file.exists()
    with pytest.raises(cpu_features.NotNativeError, match="dtype='bfloat16' needs"):
        from transformer_ext.translate import Translator

        Translator.from_model_dir(tmp_path / "never-read", dtype="bfloat16")  # refused before the folder


def test_translate_cli_dtype_is_for_the_eager_runtime(capsys):
    code, _, err = _translate_cli(["--dtype", "bfloat16", "--runtime", "onnxruntime", "forty-two"], capsys)
    assert code == 2 and "--dtype applies to the eager runtime only" in err
    code, _, err = _translate_cli(["--dtype", "float16", "forty-two"], capsys)
    assert code == 2 and "--dtype" in err


def _evaluate_cli(argv, capsys):
    from transformer_ext.evaluate import main

    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_evaluate_cli_dtype_bfloat16_scores_the_bfloat16_translations(native, capsys, tmp_path, one_thread):
    pytest.importorskip("sacrebleu")
    from transformer_ext.evaluate import score_texts
    from transformer_ext.translate import Translator

    sources = ["forty-two", "one thousand and one", "seven hundred and six", "ninety"]
    src, ref, hyp = tmp_path / "src", tmp_path / "ref", tmp_path / "hyp"
    src.write_text("".join(s + "\n" for s in sources))
    ref.write_text("zweiundvierzig\neintausendeins\nsiebenhundertsechs\nneunzig\n")
    argv = ["--model", str(DEMO_DIR), "--src", str(src), "--ref", str(ref), "--output", str(hyp), "--json"]
    code, out, _ = _evaluate_cli(argv + ["--dtype", "bfloat16"], capsys)
    assert code == 0
    report = json.loads(out)
    assert report["runtime"] == "eager bfloat16"
    # the hypotheses are a bfloat16 translator's, and the score is sacrebleu's on them
    expected = Translator.from_model_dir(DEMO_DIR, dtype="bfloat16").translate(sources)
    assert hyp.read_text().splitlines() == expected
    assert report["bleu"] == pytest.approx(
        score_texts(expected, ref.read_text().splitlines())["bleu"], abs=0.005
    )


def test_evaluate_cli_dtype_bfloat16_refused_where_not_native_or_on_an_export(
    not_native, capsys, tmp_path, exported_portable
):
    src, ref, hyp = tmp_path / "src", tmp_path / "ref", tmp_path / "hyp"
    src.write_text("forty-two\n")
    ref.write_text("zweiundvierzig\n")
    base = ["--src", str(src), "--ref", str(ref), "--output", str(hyp), "--dtype", "bfloat16"]
    code, out, err = _evaluate_cli(["--model", str(DEMO_DIR)] + base, capsys)
    lines = err.strip().splitlines()
    assert code == 1 and out == "" and len(lines) == 1, err
    assert "--dtype bfloat16 needs a CPU with native bfloat16" in lines[0]
    code, out, err = _evaluate_cli(["--model", str(exported_portable)] + base, capsys)
    assert code == 1 and "--dtype applies to a model folder" in err and "Traceback" not in err, err
    assert not hyp.exists()
