"""Generated from proto/dra/v1; do not edit."""
