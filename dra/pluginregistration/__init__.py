"""Generated from proto/dra/pluginregistration; do not edit."""
