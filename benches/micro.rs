//! Micro-benchmarks of the hot paths that do not touch the network: sha256 verification (every
//! byte from a peer is hashed), the `/v2/` path and Range parsers (every request), and the
//! hosts.toml merge (at start and every 60 s). `cargo bench --bench micro`.

#![allow(clippy::unwrap_used)] // benchmark inputs are fixed and valid

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use ferry::containerd_config::hosts::{self, Ipv6Hosts};
use ferry::oci::{Digest, path, range};

fn sha256_verification(c: &mut Criterion) {
    let mut group = c.benchmark_group("sha256");
    for size in [64 * 1024, 4 * 1024 * 1024] {
        let data: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
        let digest = Digest::sha256_of(&data);
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_with_input(BenchmarkId::from_parameter(size), &data, |b, data| {
            b.iter(|| {
                let mut hasher = digest.hasher();
                // Chunked as a body arrives.
                for chunk in data.chunks(16 * 1024) {
                    hasher.update(chunk);
                }
                assert!(hasher.matches(&digest));
            })
        });
    }
    group.finish();
}

fn parsers(c: &mut Criterion) {
    let blob = "/v2/library/nginx/blobs/sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
    let manifest = "/v2/org/team/app/manifests/v1.2.3";
    c.bench_function("path/blob", |b| {
        b.iter(|| path::parse(std::hint::black_box(blob)).unwrap())
    });
    c.bench_function("path/manifest-tag", |b| {
        b.iter(|| path::parse(std::hint::black_box(manifest)).unwrap())
    });
    c.bench_function("range/suffix", |b| {
        b.iter(|| range::parse(std::hint::black_box("bytes=1048576-"), 1 << 30).unwrap())
    });
}

fn hosts_merge(c: &mut Criterion) {
    let existing = "server = \"https://registry-1.docker.io\"\n\n# the operator's cache\n[host.\"https://mirror.example\"]\n  capabilities = [\"pull\", \"resolve\"]\n  ca = \"/etc/pki/ca.pem\"\n\n[host.\"https://registry-1.docker.io\"]\n  capabilities = [\"pull\", \"resolve\"]\n";
    let merged = match hosts::merge(existing, "http://127.0.0.1:5480", Ipv6Hosts::Dotted).unwrap() {
        hosts::Merged::Updated(text) => text,
        other => panic!("{other:?}"),
    };
    c.bench_function("hosts/merge", |b| {
        b.iter(|| {
            hosts::merge(
                std::hint::black_box(existing),
                "http://127.0.0.1:5480",
                Ipv6Hosts::Dotted,
            )
            .unwrap()
        })
    });
    c.bench_function("hosts/merge-again-unchanged", |b| {
        b.iter(|| {
            hosts::merge(
                std::hint::black_box(&merged),
                "http://127.0.0.1:5480",
                Ipv6Hosts::Dotted,
            )
            .unwrap()
        })
    });
    c.bench_function("hosts/cleanup", |b| {
        b.iter(|| hosts::cleanup(std::hint::black_box(&merged)))
    });
}

/// Reading a blob file from the page cache as the mirror serves it (`files::open`): the read
/// path's own cost, without HTTP. Ferry-vs-nginx in `bench.sh` is the end-to-end figure.
fn blob_file_stream(c: &mut Criterion) {
    use ferry::oci::Digest;
    use futures::StreamExt;
    let dir = tempfile::tempdir().unwrap();
    let size = 64 << 20;
    let data = vec![7u8; size];
    let digest = Digest::sha256_of(&data);
    let path = ferry::store::containerd::files::blob_path(dir.path(), &digest);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, &data).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut group = c.benchmark_group("blob-file-stream");
    group.throughput(Throughput::Bytes(size as u64));
    group.sample_size(20);
    group.bench_function("64MiB", |b| {
        b.iter(|| {
            rt.block_on(async {
                let mut stream = ferry::store::containerd::files::open(
                    dir.path(),
                    &digest,
                    size as u64,
                    0,
                    size as u64,
                )
                .await
                .unwrap();
                let mut n = 0;
                while let Some(chunk) = stream.next().await {
                    n += chunk.unwrap().len();
                }
                assert_eq!(n, size);
            })
        })
    });
    group.finish();
}

criterion_group!(
    benches,
    sha256_verification,
    parsers,
    hosts_merge,
    blob_file_stream
);
criterion_main!(benches);
