# kvmesh — build, test, bench. `make test` is the README's test command and what CI runs.
GO        ?= go
BINARIES  := router sidecar enginesim loadtest healthcheck fleetsim
FUZZTIME  ?= 5s
# The revision stamped into the binaries (buildinfo.Version, in logs and
# metrics); empty outside git, where the binaries fall back to Go's own stamp.
REVISION  := $(shell git describe --always --dirty --abbrev=12 2>/dev/null)
LDFLAGS   := -s -w -X github.com/kvmesh/kvmesh/buildinfo.revision=$(REVISION)
# Static binaries whatever the caller's environment says (the images are
# FROM scratch); unit turns cgo back on for the race detector.
export CGO_ENABLED := 0

.PHONY: build test vet fmt-check unit fuzz bench bench-proxy clean

build:
	@mkdir -p bin
	$(GO) build -trimpath -ldflags='$(LDFLAGS)' -o bin/ $(addprefix ./cmd/,$(BINARIES))

vet:
	$(GO) vet ./...

fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

# -race needs cgo.
unit:
	CGO_ENABLED=1 $(GO) test -race -timeout 10m ./...

fuzz:
	FUZZTIME=$(FUZZTIME) scripts/fuzz-short

test: build vet fmt-check unit fuzz e2e

bench:
	$(GO) test -run '^$$' -bench . -benchmem ./...

# Router vs nginx keep-alive proxy on one upstream (installs nginx if root).
bench-proxy:
	scripts/bench-proxy

clean:
	rm -rf bin

# --- docker demo cluster (docker-compose.yml) and its end-to-end tests ---
# `docker compose` (v2) when it answers, else docker-compose (v1.29+).
COMPOSE   ?= $(shell docker compose version >/dev/null 2>&1 && echo "docker compose" || echo docker-compose)
IMAGE     ?= kvmesh:dev
# KVMESH_TOKENIZER_DIR=/path/to/hf-model make up: enginesim and routers load it.
COMPOSE_FILES := -f docker-compose.yml $(if $(KVMESH_TOKENIZER_DIR),-f deploy/docker/compose.tokenizer.yml)
COMPOSE_ENV   := $(if $(KVMESH_TOKENIZER_DIR),KVMESH_TOKENIZER_SPEC=/tokenizer)

.PHONY: images up down e2e help

help:
	@echo "make up       build bin/ and the kvmesh:dev image (offline), start the demo, wait for both routers"
	@echo "              (KVMESH_ROUTER1_PUBLISH / KVMESH_ROUTER2_PUBLISH move their host ports; a failed"
	@echo "              start is taken down again, KVMESH_UP_KEEP=1 keeps it)"
	@echo "make down     stop the demo"
	@echo "make images   the image only, FROM scratch from bin/ (no network)"
	@echo "make build    static binaries in bin/"
	@echo "make test     what CI runs: build, vet, gofmt, go test -race ./..., short fuzz runs, e2e"
	@echo "make e2e      the docker end-to-end tests"
	@echo "docker compose up -d   the demo without Go or make: builds the image from source (network needed)"

# One FROM-scratch image holding the cluster's binaries (loadtest stays out:
# it runs on the host); the context is bin/ only, so the build needs no
# network.
IMAGE_BINARIES := router sidecar enginesim healthcheck
images:
	@mkdir -p bin
	$(GO) build -trimpath -ldflags='$(LDFLAGS)' -o bin/ $(addprefix ./cmd/,$(IMAGE_BINARIES))
	docker build -q -f deploy/docker/Dockerfile -t $(IMAGE) bin

# Start the demo from that image (compose --no-build: nothing is built from
# source or pulled), wait (bounded) until both routers are ready on the ports
# they really publish, and take a partial stack down again if that fails
# (deploy/docker/up says how).
up: images
	$(COMPOSE_ENV) KVMESH_IMAGE=$(IMAGE) COMPOSE="$(COMPOSE)" COMPOSE_FILES="$(COMPOSE_FILES)" deploy/docker/up

down:
	$(COMPOSE) $(COMPOSE_FILES) down --remove-orphans --timeout 5

# End-to-end tests on the docker stack: they build their own image from
# freshly built binaries, give each test its own compose project and tear it
# down always. They skip with a message when no Docker engine answers, and
# under plain `go test ./...` (they need KVMESH_E2E=1: minutes, not seconds).
e2e:
	GO=$(GO) scripts/e2e
