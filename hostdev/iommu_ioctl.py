"""The `IOMMU_OPTION` ioctl on an iommufd (`/dev/iommu`), from Linux `uapi/linux/iommufd.h`.

Only the one option the hand-off needs: `IOMMU_OPTION_RLIMIT_MODE`, which decides whether pinned
memory is charged to the memlock limit of the user (0, the default) or of the process that holds the
fd (1). libvirt sets 1 when it opens `/dev/iommu` itself; a prepared fd must arrive the same way.
"""

from __future__ import annotations

import fcntl
import struct

# _IO(IOMMUFD_TYPE=';', IOMMUFD_CMD_OPTION=0x87): no size or direction bits, the struct carries
# its own size.
IOMMU_OPTION = 0x3B87
IOMMU_OPTION_RLIMIT_MODE = 0
IOMMU_OPTION_OP_SET = 0
IOMMU_OPTION_OP_GET = 1
RLIMIT_MODE_PER_USER = 0
RLIMIT_MODE_PER_PROCESS = 1

# struct iommu_option {u32 size; u32 option_id; u16 op; u16 __reserved; u32 object_id; u64 val64;}
# in host byte order; every field is naturally aligned, so no padding.
_IOMMU_OPTION = struct.Struct("=IIHHIQ")


def build_option(option_id: int, op: int, val64: int = 0, object_id: int = 0) -> bytes:
    """The bytes of a `struct iommu_option` (24 bytes) for the kernel."""
    return _IOMMU_OPTION.pack(_IOMMU_OPTION.size, option_id, op, 0, object_id, val64)


def parse_option_val64(raw: bytes | bytearray) -> int:
    """The `val64` field of a `struct iommu_option` the kernel filled in (a GET answer)."""
    if len(raw) != _IOMMU_OPTION.size:
        raise ValueError(f"struct iommu_option is {_IOMMU_OPTION.size} bytes, got {len(raw)}")
    return int(_IOMMU_OPTION.unpack(raw)[5])


def set_rlimit_mode_per_process(fd: int) -> None:
    """Charge pinned memory to the memlock limit of the process holding `fd`.

    Must run right after `/dev/iommu` is opened (EBUSY once the fd owns objects); needs
    CAP_SYS_RESOURCE (EPERM otherwise). Raises the kernel's OSError as is.
    """
    option = build_option(IOMMU_OPTION_RLIMIT_MODE, IOMMU_OPTION_OP_SET, RLIMIT_MODE_PER_PROCESS)
    fcntl.ioctl(fd, IOMMU_OPTION, option)


def read_rlimit_mode(fd: int) -> int:
    """The current RLIMIT_MODE of `fd`: RLIMIT_MODE_PER_USER or RLIMIT_MODE_PER_PROCESS."""
    option = bytearray(build_option(IOMMU_OPTION_RLIMIT_MODE, IOMMU_OPTION_OP_GET))
    fcntl.ioctl(fd, IOMMU_OPTION, option, True)
    return parse_option_val64(option)
