defmodule LlamaCppEx.HubTest do
  @moduledoc """
  `LlamaCppEx.Hub` against `LlamaCppEx.Test.HubServer`, a stand-in for the Hub on 127.0.0.1
  (no test needs the internet): downloads, the cache, checksums, errors, tokens, offline mode,
  progress and path guards; then `load_model_from_hub/3` with a real tiny model.
  """
  # environment variables (LLAMA_OFFLINE, HF_TOKEN) are process-global
  use ExUnit.Case, async: false

  import ExUnit.CaptureLog

  alias LlamaCppEx.Hub
  alias LlamaCppEx.Test.HubServer

  doctest LlamaCppEx.Hub

  @model Path.expand("fixtures/tiny/tiny-qwen2-f32.gguf", __DIR__)

  setup do
    body = :crypto.strong_rand_bytes(300_000)

    repos = %{
      "org/model" => %{
        files: %{
          "model-Q4.gguf" => %{body: body},
          "small.gguf" => %{body: "tiny"},
          "README.md" => %{body: "# readme", lfs: false},
          "corrupt.gguf" => %{body: "actual bytes", sha256: String.duplicate("0", 64)},
          "cut.gguf" => %{body: body, truncate: 1000},
          "tiny.gguf" => %{body: File.read!(@model)}
        }
      },
      "org/private" => %{token: "secret", files: %{"p.gguf" => %{body: "private"}}}
    }

    {server, url} = HubServer.start(repos)
    cache = Path.join(System.tmp_dir!(), "llama_cpp_ex_hub_#{System.unique_integer([:positive])}")

    for v <- ~w(LLAMA_OFFLINE HF_TOKEN HUGGING_FACE_HUB_TOKEN HF_ENDPOINT LLAMA_CACHE_DIR),
        do: System.delete_env(v)

    on_exit(fn ->
      HubServer.stop(server)
      File.rm_rf!(cache)
      System.delete_env("LLAMA_OFFLINE")
    end)

    %{server: server, opts: [endpoint: url, cache_dir: cache], body: body, cache: cache}
  end

  test "downloads, verifies, caches with private modes, and serves from the cache", ctx do
    parent = self()
    progress = fn p -> send(parent, {:progress, p}) end

    assert {:ok, path} =
             Hub.download("org/model", "model-Q4.gguf", [progress: progress] ++ ctx.opts)

    assert path == Path.join([ctx.cache, "org/model/main/model-Q4.gguf"])
    assert File.read!(path) == ctx.body
    assert File.stat!(path).mode |> Bitwise.band(0o777) == 0o600
    assert File.stat!(Path.dirname(path)).mode |> Bitwise.band(0o777) == 0o700

    assert File.read!(path <> ".etag") =~
             Base.encode16(:crypto.hash(:sha256, ctx.body), case: :lower)

    assert File.stat!(path <> ".etag").mode |> Bitwise.band(0o777) == 0o600
    # no temporary file is left behind
    assert File.ls!(Path.dirname(path)) |> Enum.sort() == ["model-Q4.gguf", "model-Q4.gguf.etag"]

    assert_received {:progress, {0, 300_000}}
    assert_received {:progress, {300_000, 300_000}}

    # cached: no request at all, even offline
    n = length(HubServer.requests(ctx.server))
    System.put_env("LLAMA_OFFLINE", "1")
    assert {:ok, ^path} = Hub.download("org/model", "model-Q4.gguf", ctx.opts)
    assert length(HubServer.requests(ctx.server)) == n
    System.delete_env("LLAMA_OFFLINE")

    # force: downloaded again
    assert {:ok, ^path} = Hub.download("org/model", "model-Q4.gguf", [force: true] ++ ctx.opts)
    assert length(HubServer.requests(ctx.server)) == n + 2
  end

  test "a checksum mismatch, a truncated transfer and a 404 leave no file", ctx do
    assert {:error, msg} = Hub.download("org/model", "corrupt.gguf", ctx.opts)
    assert msg =~ "checksum mismatch for org/model/corrupt.gguf"
    assert msg =~ String.duplicate("0", 64)

    assert {:error, msg} = Hub.download("org/model", "cut.gguf", ctx.opts)
    assert msg =~ "truncated"

    assert {:error, msg} = Hub.download("org/model", "missing.gguf", ctx.opts)
    assert msg == "file not found in org/model@main: missing.gguf"

    assert {:error, msg} = Hub.download("org/nope", "x.gguf", ctx.opts)
    assert msg =~ "repository not found: org/nope"

    dir = Path.join(ctx.cache, "org/model/main")
    assert File.ls(dir) in [{:ok, []}, {:error, :enoent}]
  end

  test "verify_checksum: without a published SHA-256, :best_effort and false download", ctx do
    assert {:error, msg} = Hub.download("org/model", "README.md", ctx.opts)
    assert msg =~ "publishes no SHA-256"
    assert msg =~ ":best_effort" and msg =~ "verify_checksum: false"

    log =
      capture_log(fn ->
        assert {:ok, p} =
                 Hub.download(
                   "org/model",
                   "README.md",
                   [verify_checksum: :best_effort] ++ ctx.opts
                 )

        assert File.read!(p) == "# readme"
      end)

    assert log =~ "no SHA-256"

    log =
      capture_log(fn ->
        assert {:ok, _} =
                 Hub.download("org/model", "corrupt.gguf", [verify_checksum: false] ++ ctx.opts)
      end)

    assert log =~ "integrity verification disabled for org/model/corrupt.gguf"

    assert {:error, msg} =
             Hub.download("org/model", "x.gguf", [verify_checksum: :maybe] ++ ctx.opts)

    assert msg =~ "invalid :verify_checksum"
  end

  test "tokens: 401 without, the option or HF_TOKEN with", ctx do
    assert {:error, msg} = Hub.download("org/private", "p.gguf", ctx.opts)
    assert msg =~ "authentication required"
    assert {:error, msg} = Hub.list_gguf_files("org/private", endpoint: ctx.opts[:endpoint])
    assert msg =~ "authentication required — set HF_TOKEN or pass :token option"

    assert {:ok, p} = Hub.download("org/private", "p.gguf", [token: "secret"] ++ ctx.opts)
    assert File.read!(p) == "private"

    System.put_env("HF_TOKEN", "secret")
    assert Hub.auth_headers([]) == [{"authorization", "Bearer secret"}]
    assert Hub.auth_headers(token: "mine") == [{"authorization", "Bearer mine"}]
    assert {:ok, _} = Hub.download("org/private", "p.gguf", [force: true] ++ ctx.opts)
  after
    System.delete_env("HF_TOKEN")
  end

  test "offline mode refuses what is not cached, without a request", ctx do
    System.put_env("LLAMA_OFFLINE", "true")
    n = length(HubServer.requests(ctx.server))

    assert Hub.download("org/model", "small.gguf", ctx.opts) ==
             {:error, "offline mode enabled but file not cached: org/model/small.gguf"}

    assert length(HubServer.requests(ctx.server)) == n
  end

  test "listing, metadata and search", ctx do
    assert {:ok, files} = Hub.list_gguf_files("org/model", endpoint: ctx.opts[:endpoint])
    assert hd(files) == %{filename: "small.gguf", size: 4}
    refute Enum.any?(files, &(&1.filename == "README.md"))
    assert Enum.map(files, & &1.size) == Enum.sort(Enum.map(files, & &1.size))

    assert {:ok, %{"id" => "org/model", "siblings" => [_ | _]}} =
             Hub.get_model_info("org/model", endpoint: ctx.opts[:endpoint])

    assert {:ok, [%{id: "org/private", downloads: 7}]} =
             Hub.search("private", endpoint: ctx.opts[:endpoint])
  end

  test "cache_path refuses paths that leave the cache" do
    for {repo, file, rev, what} <- [
          {"../etc", "f.gguf", "main", "invalid repository id"},
          {"org/m", "../../x", "main", "invalid filename"},
          {"org/m", "/abs.gguf", "main", "invalid filename"},
          {"org/m", "a\\b.gguf", "main", "invalid filename"},
          {"org/m", "C:x.gguf", "main", "invalid filename"},
          {"org/m", "~/x.gguf", "main", "invalid filename"},
          {"org//m", "f.gguf", "main", "invalid repository id"},
          {"org/m", "f\0.gguf", "main", "invalid filename"},
          {"org/m", "f.gguf", "..", "invalid revision"},
          {"org/m", "", "main", "invalid filename"},
          {"org/m", :f, "main", "invalid filename"}
        ] do
      assert_raise ArgumentError, ~r/^#{what}/, fn ->
        Hub.cache_path(repo, file, revision: rev, cache_dir: "/c")
      end
    end

    assert {:error, "invalid filename" <> _} = Hub.download("org/m", "../x", cache_dir: "/c")
  end

  test "proxy options" do
    assert Hub.proxy_request_options("https://huggingface.co/x", proxy: false) == []

    assert [
             connect_options: [
               proxy: {:http, "p.local", 3128, []},
               proxy_headers: [{"proxy-authorization", "Basic " <> b64}]
             ]
           ] =
             Hub.proxy_request_options("https://huggingface.co/x",
               proxy: "http://u:pw@p.local:3128"
             )

    assert Base.decode64!(b64) == "u:pw"

    assert Hub.proxy_request_options("https://huggingface.co/x",
             proxy: "http://p.local:3128",
             no_proxy: ".co"
           ) == []
  end

  test "load_model_from_hub downloads and loads", ctx do
    assert {:ok, model} = LlamaCppEx.load_model_from_hub("org/model", "tiny.gguf", ctx.opts)
    assert LlamaCppEx.Model.architecture(model) == "qwen2"
    assert {:error, msg} = LlamaCppEx.load_model_from_hub("org/model", "small.gguf", ctx.opts)
    assert msg =~ "failed to load model"
  end
end
