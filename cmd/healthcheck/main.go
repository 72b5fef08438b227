// Command healthcheck GETs a URL and exits 0 on a 2xx answer, 1 otherwise.
// Images are built FROM scratch, without a shell or curl, so container
// health checks run this instead: healthcheck http://127.0.0.1:8080/ready
package main

import (
	"fmt"
	"net/http"
	"os"
	"time"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: healthcheck URL")
		os.Exit(2)
	}
	client := http.Client{Timeout: 2 * time.Second}
	resp, err := client.Get(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		fmt.Fprintln(os.Stderr, resp.Status)
		os.Exit(1)
	}
}
