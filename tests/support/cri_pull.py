"""Pulls an image the way the kubelet does: containerd's CRI `runtime.v1.ImageService/PullImage`
(no crictl is packaged here). The messages come from the CRI's own api.proto (k8s.io/cri-api,
`pkg/apis/runtime/v1/api.proto`, Apache-2.0, next to this file), compiled at each run with
grpcio-tools into a scratch directory.

Usage: cri_pull.py <containerd socket> <image reference> [remove]
Prints the image ref containerd returns; exits 1 with the gRPC error when the pull fails.
With `remove`, removes the image instead, as the kubelet's image garbage collection does
(`RemoveImage`).
"""
import atexit
import os
import shutil
import subprocess
import sys
import tempfile

here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cri")
out = tempfile.mkdtemp(prefix="ferry-cri-")
# The scratch directory goes when the script ends, whichever way (each run left one behind).
atexit.register(shutil.rmtree, out, True)
subprocess.check_call(
    [sys.executable, "-m", "grpc_tools.protoc", f"-I{here}", f"--python_out={out}",
     f"--grpc_python_out={out}", "api.proto"]
)
sys.path.insert(0, out)

import grpc  # noqa: E402
import api_pb2  # noqa: E402
import api_pb2_grpc  # noqa: E402

socket, image = sys.argv[1], sys.argv[2]
stub = api_pb2_grpc.ImageServiceStub(grpc.insecure_channel("unix://" + socket))
if sys.argv[3:] == ["remove"]:
    try:
        stub.RemoveImage(api_pb2.RemoveImageRequest(image=api_pb2.ImageSpec(image=image)), timeout=60)
    except grpc.RpcError as e:
        print(f"RemoveImage {image}: {e.code()}: {e.details()}", file=sys.stderr)
        sys.exit(1)
    sys.exit(0)
try:
    reply = stub.PullImage(
        api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image=image)), timeout=300
    )
except grpc.RpcError as e:
    print(f"PullImage {image}: {e.code()}: {e.details()}", file=sys.stderr)
    sys.exit(1)
print(reply.image_ref)
