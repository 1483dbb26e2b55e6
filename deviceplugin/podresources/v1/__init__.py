"""Generated from proto/deviceplugin/podresources/v1; do not edit."""
