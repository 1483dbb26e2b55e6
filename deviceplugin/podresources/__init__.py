"""Generated from proto/deviceplugin/podresources; do not edit."""
