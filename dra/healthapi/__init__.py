"""Generated from proto/dra/healthapi; do not edit."""
