"""Programs written for Ray Train's own API, which tests run on Ray and on ckval."""
