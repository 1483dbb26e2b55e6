"""Moving PCI functions between drivers, and everything that must hold while it happens.

The plan (`plan`) is a pure function of the host model and who uses each device (`holders`,
`usage`); `bind` carries it out through sysfs writes (`sysfs_write`) under the node's one binding
lock (`lock`), and rolls back on failure; `reset` resets a function after use. Every path that
rewrites a driver binding (the CLI, the init container, the device plugin's reset, DRA's
on-demand binding) goes through here.
"""
