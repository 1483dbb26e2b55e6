"""Generated from proto/launcher_hook/hooks/info; do not edit."""
