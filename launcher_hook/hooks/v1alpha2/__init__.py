"""Generated from proto/launcher_hook/hooks/v1alpha2; do not edit."""
