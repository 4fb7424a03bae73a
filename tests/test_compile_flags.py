"""compile --layout / --search reach the build, and a layout asked for the wrong target is refused before any work."""
from __future__ import annotations

import pytest


def test_flags_reach_compile_artifact(monkeypatch, tmp_path):
  from cli.commands import compile as command
  from cli.main import main
  seen: dict = {}

  class _Report:
    def table(self) -> str:
      return "ok"

  def fake(kind, models, camera, device, out, **kw):
    seen.update(kw, camera=camera, device=device)
    return _Report()

  monkeypatch.setattr(command, "compile_artifact", fake)
  args = ["compile", "--vision", "v.onnx", "--policy", "p.onnx", "-o", str(tmp_path / "a")]
  assert main(args + ["--layout", "off", "--search", "off"]) == 0
  assert (seen["layout"], seen["search"], seen["camera"], seen["device"]) == ("off", "off", (1928, 1208), "CPU")
  assert main(args) == 0
  assert seen["layout"] is None and seen["search"] is None   # unset: the environment or auto decides in the build


def test_layout_on_for_a_gpu_target_is_refused(tiny_models, tmp_path, capsys):
  from cli.main import main
  rc = main(["compile", "--vision", str(tiny_models / "driving_vision.onnx"), "--policy", str(tiny_models / "driving_policy.onnx"),
             "--device", "CUDA", "--layout", "on", "-o", str(tmp_path / "a")])
  assert rc == 2
  assert "--layout on is for CPU artifacts" in capsys.readouterr().err
  assert not (tmp_path / "a").exists()


def test_unknown_layout_is_an_argparse_error(capsys):
  from cli.main import main
  with pytest.raises(SystemExit) as e:
    main(["compile", "--vision", "v", "--policy", "p", "-o", "o", "--layout", "sideways"])
  assert e.value.code == 2 and "invalid choice: 'sideways'" in capsys.readouterr().err
