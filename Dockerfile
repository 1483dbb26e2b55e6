# syntax=docker/dockerfile:1
# One image for every subcommand: plugin, webhook, hook (and onDefineDomain), certs, inspect,
# bind/unbind, demo.
#   docker build -t kubevirt-iommufd:dev .
# Python packages are pinned in requirements/image.txt; the base image by its exact tag.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# libvirt-python compiles against libvirt's headers; the rest of the tool chain stays here.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev libvirt-dev pkg-config \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY requirements/image.txt requirements/image.txt
RUN pip wheel --no-cache-dir --wheel-dir /wheels -r requirements/image.txt
COPY pyproject.toml README.md ./
COPY hostdev hostdev
COPY deviceplugin deviceplugin
COPY launcher_hook launcher_hook
COPY webhook webhook
COPY dra dra
COPY sim sim
COPY kubevirt_iommufd kubevirt_iommufd
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
# libvirt0: libvirt-python's library (the hook asks libvirt its version); pci.ids: device and
# resource names; kmod: modprobe for `bind --driver auto`.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libvirt0 pci.ids kmod \
 && rm -rf /var/lib/apt/lists/*
# Mounted, not copied: the wheels never become a layer of the final image.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels kubevirt-iommufd
# Non-root by default (webhook, hook, certs); the device plugin's DaemonSet runs it as root.
USER 65532:65532
ENTRYPOINT ["kubevirt-iommufd"]
CMD ["--help"]
