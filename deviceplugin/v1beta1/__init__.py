"""Generated from proto/deviceplugin/v1beta1; do not edit."""
