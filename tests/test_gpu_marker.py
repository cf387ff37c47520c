"""The gpu marker's rule (tests/conftest.py): which machines a marked test runs on, and why not."""
import pytest

from tests.conftest import default_model_missing, gpu_skip_reason


def _reason(marker, devices, sm=(8, 0), interpret=False):
    return gpu_skip_reason(marker.mark, devices, lambda: sm, interpret)


def test_a_plain_gpu_test_needs_a_device_with_compiled_kernels():
    assert _reason(pytest.mark.gpu, 0) == "needs a CUDA device"
    assert _reason(pytest.mark.gpu, 1) is None
    assert _reason(pytest.mark.gpu, 1, interpret=True) == "runs compiled kernels: not under TRITON_INTERPRET=1"


def test_device_count_and_capability():
    two = pytest.mark.gpu(devices=2)
    assert _reason(two, 1) == "needs 2 CUDA devices"
    assert _reason(two, 2) is None
    sm90 = pytest.mark.gpu(capability=9)
    assert _reason(sm90, 1, sm=(8, 9)) == "needs an sm_90+ GPU"
    assert _reason(sm90, 1, sm=(9, 0)) is None
    assert _reason(sm90, 0) == "needs a CUDA device"


def test_interpretable_kernels_also_run_on_cpu_under_the_interpreter():
    kernels = pytest.mark.gpu(interpret=True)
    assert _reason(kernels, 0) == "needs a CUDA device (or TRITON_INTERPRET=1 with triton on CPU)"
    assert _reason(kernels, 0, interpret=True) is None
    assert _reason(kernels, 1) is None and _reason(kernels, 1, interpret=True) is None
    two = pytest.mark.gpu(devices=2, interpret=True)
    assert _reason(two, 0, interpret=True) is None          # both ranks on CPU
    assert _reason(two, 1, interpret=True) == "needs 2 CUDA devices (or TRITON_INTERPRET=1 with triton on CPU)"


def test_a_misspelt_argument_is_refused():
    with pytest.raises(pytest.UsageError, match="device"):
        _reason(pytest.mark.gpu(device=2), 2)


def test_a_missing_default_model_is_named(monkeypatch, tmp_path):
    assert default_model_missing() is None                  # the CPU suite runs on it: installed here
    monkeypatch.setenv("PIPESPEC_DEFAULT_MODEL", str(tmp_path / "gone.gguf"))
    gone = tmp_path / "gone.gguf"
    assert default_model_missing() == f"the default model {gone} ($PIPESPEC_DEFAULT_MODEL) does not exist"
