import re
from pathlib import Path

import pytest

from deepinfer_plugins import envs


@pytest.mark.parametrize(("value", "on_cpu", "expected"), [
    (None, True, True), (None, False, False), ("", False, False),
    ("1", False, True), ("true", True, True), ("0", True, False), ("no", False, False),
])
def test_keep_dense_weights_defaults_to_the_cpu_only(monkeypatch, value, on_cpu, expected):
    if value is None:
        monkeypatch.delenv("DEEPINFER_KEEP_DENSE_WEIGHTS", raising=False)
    else:
        monkeypatch.setenv("DEEPINFER_KEEP_DENSE_WEIGHTS", value)
    assert envs.keep_dense_weights(on_cpu=on_cpu) is expected


def test_keep_dense_weights_rejects_other_values(monkeypatch):
    monkeypatch.setenv("DEEPINFER_KEEP_DENSE_WEIGHTS", "maybe")
    with pytest.raises(ValueError, match="DEEPINFER_KEEP_DENSE_WEIGHTS"):
        envs.keep_dense_weights(on_cpu=True)


NOT_VARIABLES = {"DEEPINFER_DSPARK", "DEEPINFER_V41"}  # SGLang's speculative algorithm, vLLM's attention backend


def test_every_variable_the_package_reads_is_listed():
    package = Path(envs.__file__).parent
    named = {match for path in package.rglob("*.py") for match in re.findall(r"\bDEEPINFER_[A-Z0-9_]+\b",
                                                                             path.read_text())}
    assert named - NOT_VARIABLES <= set(envs.ENVIRONMENT), sorted(named - NOT_VARIABLES - set(envs.ENVIRONMENT))
