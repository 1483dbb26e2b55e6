"""Generated from proto/dra/v1beta1; do not edit."""
