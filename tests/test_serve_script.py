"""scripts/server_exit.sh: the exit status `make serve` / `make demo` report for tritonserver."""
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "server_exit.sh")


def status(tmp_path, log: str, rc: int) -> tuple[int, str]:
    path = tmp_path / "server.log"
    path.write_text(log)
    proc = subprocess.run(["bash", SCRIPT, str(path), str(rc)], capture_output=True, text=True, timeout=10)
    return proc.returncode, proc.stderr


def test_the_upstream_exit_timeout_is_a_note_not_a_failure(tmp_path):
    """tritonserver 2.51's exit after a Python model got no finalize (server#8755)."""
    log = ('I1126 server.cc:336] "All models are stopped, unloading models"\n'
           "error: failed to stop server: Internal - Exit timeout expired. Exiting immediately.\n")
    rc, err = status(tmp_path, log, 1)
    assert rc == 0 and "server#8755" in err


def test_any_other_failure_keeps_its_status(tmp_path):
    assert status(tmp_path, 'E1126 model_lifecycle.cc:654] "failed to load \'llm\'"\n', 1)[0] == 1
    assert status(tmp_path, "Exit timeout expired\n", 0) == (0, "")
    rc, err = status(tmp_path, "", 137)
    assert rc == 137 and err == ""
