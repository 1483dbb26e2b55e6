"""Generated from proto/launcher_hook/hooks/v1alpha3; do not edit."""
