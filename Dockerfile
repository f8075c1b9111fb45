# kvgate: a KV-cache-aware gateway for vLLM fleets.
#   docker build -t kvgate .
#   docker run -p 8080:8080 -v $PWD/config:/etc/kvgate kvgate serve --config /etc/kvgate/kvgate.yaml --host 0.0.0.0
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvgate ./kvgate
RUN pip install --no-cache-dir --prefix=/install .

FROM python:3.11-slim
RUN useradd --system --uid 10001 kvgate
COPY --from=build /install /usr/local
COPY config /etc/kvgate
USER kvgate
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=2s CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/health').status != 200)"
ENTRYPOINT ["kvgate"]
CMD ["serve", "--config", "/etc/kvgate/kvgate.yaml", "--host", "0.0.0.0"]
