"""Generated from proto/launcher_hook/hooks; do not edit."""
