"""Generated from proto/dra/pluginregistration/v1; do not edit."""
