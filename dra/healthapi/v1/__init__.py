"""Generated from proto/dra/healthapi/v1; do not edit."""
