"""What kind of filesystem a local path is on: whether bytes written there cross a network.

A path on NFS, Lustre, a parallel filesystem or a FUSE mount of an object store
(gcsfuse, mountpoint-s3, blobfuse) is a local path whose bytes are time and money
as on an object store, so `compression="auto"` compresses there
(`_save.codecpolicy.resolve_compression`). Linux only (``/proc/self/mountinfo``);
elsewhere, and for a path no mount covers, a path counts as a local disk.
"""

from __future__ import annotations

import os

#: Filesystem types whose bytes cross a network (the fstype field of mountinfo).
NETWORK_TYPES = frozenset({
    "nfs", "nfs4", "lustre", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "gpfs", "beegfs", "wekafs", "afs",
    "orangefs", "pvfs2", "ocfs2", "gfs2", "virtiofs",
})
#: FUSE types that are local: a block device (ntfs-3g, exFAT), or a kernel or container helper.
LOCAL_FUSE = frozenset({"fuseblk", "fusectl", "fuse.lxcfs", "fuse.portal", "fuse.gvfsd-fuse", "fuse.snapfuse"})

MOUNTINFO = "/proc/self/mountinfo"


def _unescape(field: str) -> str:
    """A mountinfo path field: spaces, tabs, newlines and backslashes are octal escapes there."""
    for code, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, ch)
    return field


def mount_type(path: str, mountinfo: str | None = None) -> str | None:
    """The filesystem type of the mount holding `path` (links resolved in the part of it that
    exists), from the text of /proc/self/mountinfo (read if not given); None if unknown."""
    if mountinfo is None:
        try:
            with open(MOUNTINFO, encoding="utf-8", errors="replace") as f:
                mountinfo = f.read()
        except OSError:
            return None
    head, tail = os.path.abspath(path), ""
    while not os.path.exists(head) and os.path.dirname(head) != head:  # a save's folder may not exist yet
        head, tail = os.path.dirname(head), os.path.join(os.path.basename(head), tail)
    probe = os.path.join(os.path.realpath(head), tail).rstrip("/") or "/"
    best, kind = -1, None
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)
        if len(fields) <= sep + 1:
            continue
        point = _unescape(fields[4])
        inside = probe == point or probe.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best:  # the longest mount point wins; a later mount over it too
            best, kind = len(point), fields[sep + 1]
    return kind


def is_network(fstype: str | None) -> bool:
    """Whether bytes written on a filesystem of this type cross a network."""
    if not fstype:
        return False
    if fstype in NETWORK_TYPES or fstype.split(".", 1)[0] in NETWORK_TYPES:
        return True
    return fstype.startswith("fuse") and fstype not in LOCAL_FUSE
