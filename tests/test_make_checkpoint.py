"""``hybrid-draft make-checkpoint``'s presets, as a user meets them on the command line.

That the ``cpu`` presets really serve is proven by the end-to-end test (tests/e2e), which
serves them with vLLM's CPU build.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybrid_draft.tools import cli, synth


def test_an_unknown_preset_names_the_accepted_ones(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = cli.main(
        ["make-checkpoint", str(tmp_path / "m"), "--arch", "glm4_moe", "--preset", "full"]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "--preset 'full'" in err and ", ".join(synth.GLM4_MOE_PRESETS) in err
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize(("arch", "preset"), [("deepseek_v3", "tiny"), ("qwen3_5", "default")])
def test_the_default_preset_is_the_architectures_own(
    arch: str, preset: str, tmp_path: Path
) -> None:
    out = tmp_path / arch
    assert cli.main(["make-checkpoint", str(out), "--arch", arch, "--no-tokenizer"]) == 0
    written = json.loads((out / "config.json").read_text())
    expected = synth.ARCHITECTURES[arch](preset).config
    assert written == expected


@pytest.mark.parametrize("arch", synth.CPU_SERVABLE)
def test_cpu_presets_write_a_complete_checkpoint_with_a_tokenizer(
    arch: str, tmp_path: Path
) -> None:
    out = tmp_path / arch
    assert cli.main(["make-checkpoint", str(out), "--arch", arch, "--preset", "cpu"]) == 0
    assert synth.is_complete(out) and (out / "tokenizer.json").is_file()
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
