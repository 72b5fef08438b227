# kvmesh from source: what `docker compose up` (or `docker-compose up`) builds
# on a fresh clone, with nothing but Docker installed. The builder needs the
# golang image and the Go module proxy; offline, `make up` builds the same
# image from bin/ through deploy/docker/Dockerfile instead and needs neither.
#
#   docker build -t kvmesh:dev .
#
# Multi-stage: the binaries are compiled in golang:1.26 and copied into an
# empty image, so the result is the same FROM-scratch image as the offline
# path (router, sidecar, enginesim, healthcheck; uid 65534).
ARG GO_IMAGE=golang:1.26
FROM ${GO_IMAGE} AS build
WORKDIR /src
# Static binaries for a base-less image. The golang image pins its own Go
# (GOTOOLCHAIN=local); auto lets an image older than go.mod's go line fetch
# that release from the module proxy instead of refusing to build.
ENV CGO_ENABLED=0 GOTOOLCHAIN=auto GOFLAGS=-buildvcs=false
# Modules first: their layer is reused until go.mod or go.sum change.
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# The revision in logs and metrics (make passes `git describe`; .git is not
# in the build context).
ARG REVISION=
RUN go build -trimpath -ldflags="-s -w -X github.com/kvmesh/kvmesh/buildinfo.revision=${REVISION}" \
      -o /out/ ./cmd/router ./cmd/sidecar ./cmd/enginesim ./cmd/healthcheck

FROM scratch
COPY --from=build /out/router /out/sidecar /out/enginesim /out/healthcheck /
# nobody:nogroup; every listener uses a port above 1024.
USER 65534:65534
ENTRYPOINT ["/router"]
