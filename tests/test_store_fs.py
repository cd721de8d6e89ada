"""Shared filesystems: the mount holding the database is found from a /proc/mounts text (the
longest mount-point prefix), network filesystems are named, and a writer starting on one warns
(a Python warning and an alert event on the run) with what to do."""

from __future__ import annotations

import pytest

from rampwatch import store
from rampwatch.store import fs

pytestmark = pytest.mark.timeout(60)

MOUNTS = """\
/dev/vda / ext4 rw,relatime 0 0
proc /proc proc rw,relatime 0 0
fileserver:/export/home /home nfs4 rw,relatime,vers=4.2 0 0
/dev/nvme0n1 /home/alice/scratch ext4 rw,relatime 0 0
//nas/share /mnt/nas cifs rw,relatime 0 0
alice@box:/data /mnt/ssh fuse.sshfs rw,nosuid 0 0
10.0.0.1@tcp:/lustre /lustre lustre rw 0 0
beegfs_nodev /mnt/beegfs beegfs rw 0 0
10.0.0.2:6789:/ /mnt/ceph ceph rw 0 0
/dev/sdb /mnt/nasty ext4 rw 0 0
/dev/sdc /mnt/with\\040space xfs rw 0 0
server:/x /mnt/with\\040space/nfs nfs rw 0 0
"""


@pytest.mark.parametrize(
    "folder,fstype",
    [
        ("/home/alice/runs", "nfs4"),
        ("/home", "nfs4"),
        ("/home/alice/scratch/runs", None),  # a local disk mounted inside the NFS tree
        ("/home/alice/scratchpad", "nfs4"),  # a prefix of the name is not a parent
        ("/mnt/nas/team", "cifs"),
        ("/mnt/ssh/x", "fuse.sshfs"),
        ("/lustre/project/a", "lustre"),
        ("/mnt/beegfs", "beegfs"),
        ("/mnt/ceph/runs", "ceph"),
        ("/mnt/nasty/runs", None),  # not under /mnt/nas
        ("/mnt/with space/runs", None),
        ("/mnt/with space/nfs/runs", "nfs"),
        ("/tmp", None),
    ],
)
def test_detection_from_a_mount_table(folder, fstype):
    m = fs.mount_of(folder, fs.parse_mounts(MOUNTS))
    shared = fs.shared_mount(folder, MOUNTS)
    if fstype is None:
        assert shared is None, m
    else:
        assert shared is not None and shared.fstype == fstype, m


def test_later_mounts_at_the_same_point_win():
    text = MOUNTS + "/dev/sdd /home ext4 rw 0 0\n"  # mounted over the NFS home
    assert fs.shared_mount("/home/alice/runs", text) is None


def test_no_mount_table_means_no_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(fs, "MOUNTS_FILE", str(tmp_path / "absent"))
    assert fs.shared_mount(tmp_path) is None


def test_a_writer_on_a_shared_filesystem_warns_and_records_an_alert(tmp_path, monkeypatch):
    table = tmp_path / "mounts"
    table.write_text(f"/dev/vda / ext4 rw 0 0\nsrv:/exp {tmp_path} nfs4 rw 0 0\n")
    monkeypatch.setattr(fs, "MOUNTS_FILE", str(table))  # the machine's table, as text
    db = tmp_path / "runs.duckdb"
    with pytest.warns(fs.SharedFilesystemWarning, match="SSH tunnel"):
        w = store.RunWriter.start(db, "nfs", handle_sigterm=False)
    assert w.close()
    (alert,) = store.events(db, w.run_id, kinds=["alert"])
    assert "nfs4" in alert.message and "local disk" in alert.message
    assert alert.data["filesystem"] == "nfs4" and alert.data["mount_point"] == str(tmp_path)


def test_a_writer_on_a_local_disk_says_nothing(tmp_path, monkeypatch):
    table = tmp_path / "mounts"
    table.write_text("/dev/vda / ext4 rw 0 0\n")
    monkeypatch.setattr(fs, "MOUNTS_FILE", str(table))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", fs.SharedFilesystemWarning)
        w = store.RunWriter.start(tmp_path / "runs.duckdb", "local", handle_sigterm=False)
    assert w.close() and store.events(tmp_path / "runs.duckdb", w.run_id) == []
