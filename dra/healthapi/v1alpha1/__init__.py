"""Generated from proto/dra/healthapi/v1alpha1; do not edit."""
