"""common.runtime.service.start_settings: what every service does first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from common.files.artifacts import PRIVATE_UMASK

SCRIPT = """
import os, pathlib, sys
from common.runtime.config import EnvServiceSettings
from common.runtime.service import start_settings
start_settings(EnvServiceSettings, check=True)
path = pathlib.Path(sys.argv[1])
path.write_text("a file the service writes")
print(oct(path.stat().st_mode & 0o777))
"""


def test_a_service_writes_files_only_its_user_can_read(tmp_path: Path) -> None:
    env = {**os.environ, "MARLAAS_STATE_DIR": str(tmp_path)}
    written = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "written")],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        # A usual umask in the parent, as a shell or an image gives it.
        umask=0o022,
    ).stdout.split()[-1]
    assert written == oct(0o666 & ~PRIVATE_UMASK) == "0o600"
