"""The coordinator serves its own wheel, so a second machine installs the very same edgepipe from
it (issue 42, item 3).

Fast: the wheel built from this source tree (once, into a temporary cache) is a valid wheel of
this version and this code; ``/dist/<wheel>`` serves it without the API key and refuses another
name; the commands ``serve`` prints for another machine. Slow (``-m slow``): a real ``edgepipe
serve --host 0.0.0.0``, the pip line it prints run as printed into a fresh virtual environment
(no system site packages; the dependencies from the package registry), and the worker line run
from that environment: it joins and the coordinator answers.
"""

from __future__ import annotations

import email.parser
import hashlib
import os
import re
import shlex
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from edgepipe import dist

ROOT = Path(__file__).resolve().parents[1]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dist")


@pytest.fixture(scope="module")
def wheel(cache) -> Path:
    return dist.build_wheel(cache)


def test_the_wheel_is_this_version_and_this_code(wheel):
    built = f"{VERSION}+{dist.find_source().digest()[:12]}"  # the local label names the source
    assert wheel.name == f"edgepipe-{built}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as whl:
        assert whl.testzip() is None
        info = f"edgepipe-{built}.dist-info"
        meta = email.parser.Parser().parsestr(whl.read(f"{info}/METADATA").decode())
        assert meta["Name"] == "edgepipe" and meta["Version"] == built
        requires = meta.get_all("Requires-Dist")
        assert any(r.startswith("onnxruntime==") for r in requires) and any(r.startswith("websockets==") for r in requires)
        assert "edgepipe = edgepipe.cli:app" in whl.read(f"{info}/entry_points.txt").decode()
        for rel in ("edgepipe/worker/shell.py", "edgepipe/dist.py", "edgepipe/native/src/gguf_op.c", "edgepipe/api/static/dashboard.html"):
            assert whl.read(rel) == (ROOT / rel).read_bytes(), rel
        assert not [n for n in whl.namelist() if "__pycache__" in n or n.endswith(".pyc")]


def test_the_wheel_is_made_once_per_source(wheel, cache):
    stamp = wheel.stat().st_mtime_ns
    t0 = time.monotonic()
    assert dist.build_wheel(cache) == wheel and wheel.stat().st_mtime_ns == stamp
    assert time.monotonic() - t0 < 5  # hashed, not built again


def test_the_route_serves_it_without_the_key_and_names_the_one_it_serves(native_pkg, wheel, cache):
    from edgepipe.api.app import create_app
    from edgepipe.cluster.shells.coordinator import Coordinator

    app = create_app(Coordinator(native_pkg), native_pkg, api_key="k", join_token="t")
    app.state.dist_cache = cache
    client = TestClient(app, client=("192.0.2.7", 5555))  # another machine, with neither key nor token
    served = client.get(f"/dist/{wheel.name}")
    assert served.status_code == 200, served.text
    assert hashlib.sha256(served.content).hexdigest() == dist.wheel_sha256(wheel)
    other = client.get("/dist/edgepipe-0.0.1-py3-none-any.whl")
    assert other.status_code == 404 and wheel.name in other.json()["error"]["message"]
    assert client.get("/v1/models").status_code == 401  # the API stays closed


@pytest.mark.pure
def test_the_commands_for_another_machine():
    plain = dist.join_commands("http://192.168.1.20:8420", "edgepipe-0.1.0-py3-none-any.whl", "ab" * 32, "s3cret", None)
    assert plain == ['pip install "http://192.168.1.20:8420/dist/edgepipe-0.1.0-py3-none-any.whl#sha256=' + "ab" * 32 + '"',
                     "edgepipe worker --coordinator http://192.168.1.20:8420 --join-token s3cret"]
    tls = dist.join_commands("https://10.0.0.2:8420", "edgepipe-0.1.0-py3-none-any.whl", "cd" * 32, None, "ef" * 32)
    assert tls[0].startswith('pip install --trusted-host 10.0.0.2:8420 "https://10.0.0.2:8420/dist/')
    assert tls[1] == "edgepipe worker --coordinator https://10.0.0.2:8420 --tls-fingerprint " + "ef" * 32


@pytest.mark.slow
def test_a_second_machine_installs_from_the_coordinator_and_joins(home, native_pkg, tmp_path):
    env = {**os.environ, "EDGEPIPE_HOME": str(home), "EDGEPIPE_DIST_CACHE": str(tmp_path / "dist")}
    serve = subprocess.Popen([sys.executable, "-m", "edgepipe", "serve", "--model", "smollm2", "--host", "0.0.0.0", "--port", "0", "--workers", "0",
                              "--join-token", "t0ken", "--no-advertise", "--capacity-wait", "120"],
                             env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    worker = None
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 240
        while not any(line.strip().startswith("edgepipe worker") for line in lines):
            assert time.monotonic() < deadline and serve.poll() is None, "".join(lines)
            lines.append(serve.stderr.readline())
        text = "".join(lines)
        pip_line = next(line.strip() for line in lines if line.strip().startswith("pip install"))
        worker_line = next(line.strip() for line in lines if line.strip().startswith("edgepipe worker"))
        assert "--join-token t0ken" in worker_line and "without --join-token" not in text
        port = int(re.search(r"--coordinator http://[^:]+:(\d+)", worker_line).group(1))

        venv = tmp_path / "venv"  # fresh: none of this interpreter's packages
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        python = venv / "bin" / "python"
        argv = shlex.split(pip_line)
        assert argv[:2] == ["pip", "install"]
        done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-compile", *argv[2:]],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        where = subprocess.run([str(python), "-c", "import edgepipe, onnx"], capture_output=True, text=True, cwd=tmp_path)
        assert "No module named 'onnx'" in where.stderr  # a worker's install, not this environment's
        installed = subprocess.run([str(python), "-c", "import edgepipe, importlib.metadata as m; print(edgepipe.__file__, m.version('edgepipe'))"],
                                   capture_output=True, text=True, check=True, cwd=tmp_path).stdout.split()
        assert installed[0].startswith(str(venv)) and installed[1] == f"{VERSION}+{dist.find_source().digest()[:12]}"
        # that install, a coordinator in its turn, packs the same code again from its RECORD
        again = subprocess.run([str(python), "-c", f"from pathlib import Path; from edgepipe import dist; print(dist.build_wheel(Path({str(tmp_path / 'again')!r})))"],
                               capture_output=True, text=True, check=True, cwd=tmp_path).stdout.strip()
        served = next((tmp_path / "dist").glob("*/*.whl"))
        with zipfile.ZipFile(served) as a, zipfile.ZipFile(again) as b:
            code = sorted(n for n in a.namelist() if n.startswith("edgepipe/"))
            assert code == sorted(n for n in b.namelist() if n.startswith("edgepipe/")) and all(a.read(n) == b.read(n) for n in code)

        clean = {k: v for k, v in env.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        clean["EDGEPIPE_HOME"] = str(tmp_path / "second-machine")
        worker = subprocess.Popen([str(venv / "bin" / "edgepipe"), *shlex.split(worker_line)[1:], "--device", "cpu", "--threads", "1"],
                                  env=clean, cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        import httpx

        answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=300,
                            json={"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] >= 1
    finally:
        for proc in (worker, serve):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()


def test_an_installed_edgepipe_is_packed_again_from_its_record(tmp_path):
    """No source tree (a coordinator installed from a wheel): the installed files its RECORD
    lists, without what pip wrote on install, and a RECORD whose hashes are the files'."""
    import base64
    import csv
    from importlib.metadata import PathDistribution

    site = tmp_path / "site"
    files = {"edgepipe/__init__.py": b"x = 1\n", "edgepipe/api/static/page.html": b"<p>",
             "edgepipe-9.9.dist-info/METADATA": b"Metadata-Version: 2.1\nName: edgepipe\nVersion: 9.9\n",
             "edgepipe-9.9.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
             "edgepipe-9.9.dist-info/entry_points.txt": b"[console_scripts]\nedgepipe = edgepipe.cli:app\n",
             "edgepipe-9.9.dist-info/INSTALLER": b"pip\n", "edgepipe-9.9.dist-info/direct_url.json": b"{}",
             "edgepipe/__pycache__/__init__.cpython-311.pyc": b"\0"}
    for rel, data in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(data)
    (site / "edgepipe-9.9.dist-info/RECORD").write_text("".join(f"{rel},,\n" for rel in files) + "../../../bin/edgepipe,,\n")
    source = dist.installed_source(PathDistribution(site / "edgepipe-9.9.dist-info"))
    assert source.root is None and source.version == "9.9"
    wheel = dist.build_wheel(tmp_path / "cache", source)
    assert wheel.name == "edgepipe-9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        assert names == {"edgepipe/__init__.py", "edgepipe/api/static/page.html", "edgepipe-9.9.dist-info/METADATA",
                         "edgepipe-9.9.dist-info/WHEEL", "edgepipe-9.9.dist-info/entry_points.txt", "edgepipe-9.9.dist-info/RECORD"}
        rows = list(csv.reader(whl.read("edgepipe-9.9.dist-info/RECORD").decode().splitlines()))
        for rel, digest, size in rows:
            if rel.endswith("RECORD"):
                continue
            data = whl.read(rel)
            assert data == files[rel] and int(size) == len(data)
            assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
