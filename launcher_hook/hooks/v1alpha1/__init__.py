"""Generated from proto/launcher_hook/hooks/v1alpha1; do not edit."""
