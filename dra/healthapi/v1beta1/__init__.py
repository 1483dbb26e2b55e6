"""Generated from proto/dra/healthapi/v1beta1; do not edit."""
