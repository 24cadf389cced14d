"""Fault-injecting file systems for tests: the public ``asyncsave.testing`` under
the names the suite has always used (``FaultyFS`` is
:class:`asyncsave.testing.FaultyFileSystem`). New tests import
``asyncsave.testing`` directly."""

from __future__ import annotations

from asyncsave.testing import FILE_OPS as OPS
from asyncsave.testing import PROCEED, block, kill, pause, raise_errno
from asyncsave.testing import FaultyFileSystem as FaultyFS

__all__ = ["OPS", "PROCEED", "FaultyFS", "block", "kill", "pause", "raise_errno"]
