"""train's options that exclude each other are usage errors: exit code 2 and one line naming them,
before any folder is read."""

from __future__ import annotations

import pytest

from transformer_ext.train import main


@pytest.mark.parametrize(
    "extra, named",
    [(["--d-model", "64"], "--d-model"), (["--preset", "tiny", "--n-heads", "2"], "--n-heads")],
)
def test_init_from_with_an_architecture_option_exits_2(tmp_path, capsys, extra, named):
    missing = tmp_path / "no-such-model"  # never read: the conflict is found first
    argv = ["--init-from", str(missing), "--train", "a.src", "a.tgt", "--valid", "b.src", "b.tgt"]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--output-dir", str(tmp_path / "run"), *extra])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--init-from" in err and named in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
