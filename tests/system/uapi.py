"""The few iommufd and VFIO cdev ioctls the system test makes, from Linux 6.12's uapi headers.

Every command here is `_IO(';', nr)` (type ';' = 0x3B, no size or direction bits: each struct
carries its own size in its first field), so the number is `0x3B00 | nr`:

- include/uapi/linux/iommufd.h: `IOMMUFD_TYPE ';'`, `IOMMUFD_CMD_DESTROY = 0x80`,
  `IOMMUFD_CMD_IOAS_ALLOC = 0x81`, `IOMMUFD_CMD_IOAS_MAP = 0x85` (`IOMMU_OPTION` is 0x87, in
  hostdev/iommu_ioctl.py);
- include/uapi/linux/vfio.h: `VFIO_TYPE ';'`, `VFIO_BASE 100`; `VFIO_DEVICE_GET_INFO` is
  `VFIO_BASE + 7`, `VFIO_DEVICE_GET_REGION_INFO` `+ 8`, `VFIO_DEVICE_BIND_IOMMUFD` `+ 18`,
  `VFIO_DEVICE_ATTACH_IOMMUFD_PT` `+ 19`, `VFIO_DEVICE_DETACH_IOMMUFD_PT` `+ 20`.

All structs are fixed layouts of naturally aligned u32s and u64s (no padding), packed in host
byte order.
"""

from __future__ import annotations

import fcntl
import struct

_TYPE = ord(";") << 8
_VFIO_BASE = 100

IOMMU_DESTROY = _TYPE | 0x80
IOMMU_IOAS_ALLOC = _TYPE | 0x81
IOMMU_IOAS_MAP = _TYPE | 0x85
VFIO_DEVICE_GET_INFO = _TYPE | (_VFIO_BASE + 7)
VFIO_DEVICE_GET_REGION_INFO = _TYPE | (_VFIO_BASE + 8)
VFIO_DEVICE_BIND_IOMMUFD = _TYPE | (_VFIO_BASE + 18)
VFIO_DEVICE_ATTACH_IOMMUFD_PT = _TYPE | (_VFIO_BASE + 19)
VFIO_DEVICE_DETACH_IOMMUFD_PT = _TYPE | (_VFIO_BASE + 20)

VFIO_DEVICE_FLAGS_PCI = 1 << 1
IOMMU_IOAS_MAP_FIXED_IOVA = 1 << 0
IOMMU_IOAS_MAP_WRITEABLE = 1 << 1
IOMMU_IOAS_MAP_READABLE = 1 << 2
VFIO_PCI_BAR0_REGION_INDEX = 0
VFIO_PCI_CONFIG_REGION_INDEX = 7

# struct iommu_destroy {u32 size; u32 id;}
_DESTROY = struct.Struct("=II")
# struct iommu_ioas_alloc {u32 size; u32 flags; u32 out_ioas_id;}
_IOAS_ALLOC = struct.Struct("=III")
# struct iommu_ioas_map {u32 size; u32 flags; u32 ioas_id; u32 __reserved; u64 user_va;
#                        u64 length; u64 iova;}
_IOAS_MAP = struct.Struct("=IIIIQQQ")
# struct vfio_region_info {u32 argsz; u32 flags; u32 index; u32 cap_offset; u64 size; u64 offset;}
_REGION_INFO = struct.Struct("=IIIIQQ")
# struct vfio_device_bind_iommufd {u32 argsz; u32 flags; s32 iommufd; u32 out_devid;}
_BIND = struct.Struct("=IIiI")
# struct vfio_device_attach_iommufd_pt {u32 argsz; u32 flags; u32 pt_id;}
_ATTACH = struct.Struct("=III")
# struct vfio_device_detach_iommufd_pt {u32 argsz; u32 flags;}
_DETACH = struct.Struct("=II")
# struct vfio_device_info {u32 argsz; u32 flags; u32 num_regions; u32 num_irqs; u32 cap_offset;
#                          u32 pad;}
_DEVICE_INFO = struct.Struct("=IIIIII")


def ioas_alloc(iommufd: int) -> int:
    """A new IO address space in `iommufd`; its object id."""
    buffer = bytearray(_IOAS_ALLOC.pack(_IOAS_ALLOC.size, 0, 0))
    fcntl.ioctl(iommufd, IOMMU_IOAS_ALLOC, buffer, True)
    return int(_IOAS_ALLOC.unpack(buffer)[2])


def destroy(iommufd: int, object_id: int) -> None:
    fcntl.ioctl(iommufd, IOMMU_DESTROY, _DESTROY.pack(_DESTROY.size, object_id))


def ioas_map(iommufd: int, ioas_id: int, user_va: int, length: int, iova: int) -> int:
    """Map `length` bytes of this process's memory at `user_va` to `iova` (fixed), for DMA both
    ways; the IOVA the kernel used."""
    flags = IOMMU_IOAS_MAP_FIXED_IOVA | IOMMU_IOAS_MAP_READABLE | IOMMU_IOAS_MAP_WRITEABLE
    buffer = bytearray(_IOAS_MAP.pack(_IOAS_MAP.size, flags, ioas_id, 0, user_va, length, iova))
    fcntl.ioctl(iommufd, IOMMU_IOAS_MAP, buffer, True)
    return int(_IOAS_MAP.unpack(buffer)[6])


def region_info(device_fd: int, index: int) -> tuple[int, int, int]:
    """(flags, size, offset in the device fd) of a VFIO device region."""
    buffer = bytearray(_REGION_INFO.pack(_REGION_INFO.size, 0, index, 0, 0, 0))
    fcntl.ioctl(device_fd, VFIO_DEVICE_GET_REGION_INFO, buffer, True)
    _argsz, flags, _index, _cap, size, offset = _REGION_INFO.unpack(buffer)
    return int(flags), int(size), int(offset)


def bind_iommufd(device_fd: int, iommufd: int) -> int:
    """Bind an opened VFIO cdev to `iommufd`; the device id iommufd gives it."""
    buffer = bytearray(_BIND.pack(_BIND.size, 0, iommufd, 0))
    fcntl.ioctl(device_fd, VFIO_DEVICE_BIND_IOMMUFD, buffer, True)
    return int(_BIND.unpack(buffer)[3])


def attach_pt(device_fd: int, pt_id: int) -> int:
    """Attach a bound cdev to an IOAS (or HWPT); the id it ended up attached to."""
    buffer = bytearray(_ATTACH.pack(_ATTACH.size, 0, pt_id))
    fcntl.ioctl(device_fd, VFIO_DEVICE_ATTACH_IOMMUFD_PT, buffer, True)
    return int(_ATTACH.unpack(buffer)[2])


def detach_pt(device_fd: int) -> None:
    fcntl.ioctl(device_fd, VFIO_DEVICE_DETACH_IOMMUFD_PT, _DETACH.pack(_DETACH.size, 0))


def device_info(device_fd: int) -> tuple[int, int, int]:
    """(flags, num_regions, num_irqs) of a VFIO device."""
    buffer = bytearray(_DEVICE_INFO.pack(_DEVICE_INFO.size, 0, 0, 0, 0, 0))
    fcntl.ioctl(device_fd, VFIO_DEVICE_GET_INFO, buffer, True)
    _argsz, flags, regions, irqs, _cap, _pad = _DEVICE_INFO.unpack(buffer)
    return int(flags), int(regions), int(irqs)
