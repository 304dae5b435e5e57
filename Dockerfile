# The one binary, stormguard, in a small image that runs as a non-root user.
#
#   docker build -t stormguard .
#   docker run --rm stormguard --help
#
# More in deploy/README.md, "Container image". The builder's Rust is the workspace's
# rust-version; the runtime is distroless/cc (glibc, libgcc, CA certificates, no shell), whose
# Debian release matches the builder's, so the binary finds the glibc it was linked against.

FROM rust:1.88-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p stormguard \
 && install -m 0755 target/release/stormguard /usr/local/bin/stormguard

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /usr/local/bin/stormguard /usr/local/bin/stormguard
# distroless's nonroot user, by number so that Kubernetes' runAsNonRoot can verify it.
USER 65532:65532
# The proxy's usual listener and admin ports (each is set in its config or flags).
EXPOSE 8080 9901
ENTRYPOINT ["stormguard"]
