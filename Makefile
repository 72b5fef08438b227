# kvmesh — build, test, bench. `make test` is the README's test command and what CI runs.
GO        ?= go
BINARIES  := router sidecar enginesim loadtest healthcheck
FUZZTIME  ?= 10s
export CGO_ENABLED ?= 0

.PHONY: build test vet fmt-check unit fuzz bench bench-proxy clean

build:
	@mkdir -p bin
	$(GO) build -trimpath -ldflags='-s -w' -o bin/ $(addprefix ./cmd/,$(BINARIES))

vet:
	$(GO) vet ./...

fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

# -race needs cgo.
unit:
	CGO_ENABLED=1 $(GO) test -race -timeout 10m ./...

fuzz:
	FUZZTIME=$(FUZZTIME) scripts/fuzz-short

test: build vet fmt-check unit fuzz

bench:
	$(GO) test -run '^$$' -bench . -benchmem ./...

# Router vs nginx keep-alive proxy on one upstream (installs nginx if root).
bench-proxy:
	scripts/bench-proxy

clean:
	rm -rf bin
