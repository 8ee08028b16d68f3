# The ferry image: the binary on a small Debian base (the chart's cleanup hook uses its `sleep`).
FROM rust:1-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends protobuf-compiler && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked && cp target/release/ferry /ferry

FROM debian:bookworm-slim
COPY --from=build /ferry /usr/local/bin/ferry
ENTRYPOINT ["/usr/local/bin/ferry"]
CMD ["run"]
