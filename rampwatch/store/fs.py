"""Which filesystem a database lives on, and the warning when it is a shared (network) one.

Why: the store's safety rests on two kinds of file locks, our fcntl locks (readers/writer,
live spools) and DuckDB's own, and on O_APPEND writes being seen in order. On NFS, CIFS/SMB,
sshfs and the cluster filesystems (Lustre, GPFS, BeeGFS, CephFS …) these are unreliable or
absent: two writers can both think they hold the database, and a reader on another host can
see a spool half written. We cannot fix that from here; we can say so where people look, once
per run (RunWriter.start: warnings.warn and an 'alert' event on the run).

Detection reads /proc/mounts (Linux) and takes the mount whose mount point is the longest
path prefix of the database's folder (after resolving symlinks), so a local disk mounted
inside a network tree, or the reverse, is judged by the mount that holds the file.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

MOUNTS_FILE = "/proc/mounts"
# fstype as /proc/mounts spells it; "fuse.X" for FUSE filesystems
SHARED = {
    "nfs",
    "nfs4",
    "cifs",
    "smb3",
    "smbfs",
    "ncpfs",
    "afs",
    "9p",
    "lustre",
    "gpfs",
    "beegfs",
    "ceph",
    "glusterfs",
    "ocfs2",
    "gfs2",
    "orangefs",
    "pvfs2",
    "panfs",
    "davfs",
    "fuse.sshfs",
    "fuse.ceph",
    "fuse.cephfs",
    "fuse.glusterfs",
    "fuse.s3fs",
    "fuse.gcsfuse",
    "fuse.rclone",
    "fuse.juicefs",
    "fuse.beegfs",
    "fuse.lustre",
    "fuse.davfs2",
    "fuse.goofys",
    "fuse.blobfuse",
    "fuse.blobfuse2",
}
_OCTAL = re.compile(r"\\([0-7]{3})")


class SharedFilesystemWarning(UserWarning):
    """The database is on a network filesystem where its locks cannot be trusted."""


@dataclass(frozen=True)
class Mount:
    point: str
    fstype: str
    source: str


def _unescape(field: str) -> str:
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mounts(text: str) -> list[Mount]:
    """The mounts of a /proc/mounts text (spaces and such are octal escapes there: \\040)."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3:
            out.append(Mount(_unescape(parts[1]), parts[2], _unescape(parts[0])))
    return out


def _under(path: str, point: str) -> bool:
    return point == "/" or path == point or path.startswith(point.rstrip("/") + "/")


def mount_of(path: str, mounts: list[Mount]) -> Mount | None:
    """The mount holding `path` (absolute): the longest mount point that is a path prefix.
    Of several mounts at one point the last listed wins (it is the one on top)."""
    best = None
    for m in mounts:
        if _under(path, m.point) and (best is None or len(m.point) >= len(best.point)):
            best = m
    return best


def shared_mount(folder, mounts_text: str | None = None) -> Mount | None:
    """The mount holding `folder` if it is a shared filesystem, else None (also when the mount
    table cannot be read: not Linux, or no /proc)."""
    if mounts_text is None:
        try:
            with open(MOUNTS_FILE, encoding="utf-8", errors="replace") as f:
                mounts_text = f.read()
        except OSError:
            return None
    m = mount_of(os.path.realpath(folder), parse_mounts(mounts_text))
    if m is None:
        return None
    fstype = m.fstype.lower()
    return m if fstype in SHARED or fstype.split(".")[-1] in SHARED else None


def warning_text(db, m: Mount) -> str:
    return (
        f"the Rampwatch database {db} is on a shared filesystem ({m.fstype} from "
        f"{m.source}, mounted at {m.point}): its file locks are unreliable there, so two "
        "processes can corrupt it or read it half written. Put the database on a local "
        "disk of the training machine (e.g. --db /local/scratch/runs.duckdb), and view it "
        "from elsewhere through the dashboard over an SSH tunnel (ssh -L 8501:localhost:8501 "
        "HOST) rather than by opening the file over the network."
    )
