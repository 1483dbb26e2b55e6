"""The simulated world: everything outside a node's daemons that the demo, the tests and the
benchmarks stand in for — a host's sysfs and /dev (`host`) and a kernel that rewrites it on
driver writes (`kernel`), a kubelet for device plugins (`kubelet`, and its pod-resources API in
`podresources`) and for DRA drivers (`dra_kubelet`), and a Kubernetes API server over HTTPS
(`apiserver`).

No product package imports this one (tests/test_import_contracts.py); it may import them, as the
real kubelet speaks their protocols.
"""
