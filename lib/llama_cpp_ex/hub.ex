defmodule LlamaCppEx.Hub do
  @moduledoc """
  Downloads model files from the Hugging Face Hub (or any server speaking its routes) into a
  local cache, with SHA-256 verification.

      {:ok, path} =
        LlamaCppEx.Hub.download("bartowski/Qwen2.5-0.5B-Instruct-GGUF",
          "Qwen2.5-0.5B-Instruct-Q4_K_M.gguf", progress: true)

      {:ok, model} =
        LlamaCppEx.load_model_from_hub("bartowski/Qwen2.5-0.5B-Instruct-GGUF",
          "Qwen2.5-0.5B-Instruct-Q4_K_M.gguf")

  ## Where files go

  `cache_path/3`: `<cache_dir>/<repo_id>/<revision>/<filename>`, where `cache_dir` is the
  `:cache_dir` option, else `$LLAMA_CACHE_DIR`, else `~/.cache/llama_cpp_ex/models`.
  Directories are created with mode 0700 and files with mode 0600. A cached file is returned
  without any network access (unless `force: true`); with `LLAMA_OFFLINE=1` (or `true`) a file
  that is not cached is an error instead of a download.

  ## Integrity

  With `verify_checksum: true` (the default) the file's SHA-256 is taken from the repository
  metadata (`/api/models/<repo>/revision/<rev>?blobs=true`, each sibling's `lfs.sha256`) and
  compared with the downloaded bytes, which are hashed as they arrive. The file is written to
  `<dest>.<random>.part`, opened exclusively, and renamed into place only once complete and
  verified; a non-200 reply, a truncated transfer or a mismatch leaves nothing behind.
  `:best_effort` downloads (with a warning) when no checksum can be had; `false` skips
  verification (logged).

  ## Endpoint, token, proxy

  `:endpoint` (else `$HF_ENDPOINT`, else `https://huggingface.co`) lets a mirror or a local
  server stand in for the Hub. `:token` (else `$HF_TOKEN`, else `$HUGGING_FACE_HUB_TOKEN`) is
  sent as a bearer token. Proxies come from `:proxy` (a URL, or `false`), else
  `HTTPS_PROXY` / `HTTP_PROXY` / `ALL_PROXY`, minus the hosts of `:no_proxy` / `NO_PROXY`.

  ## HTTP client

  Requests go through OTP's `:httpc` (with `:ssl` verifying the peer against the OS's CA
  store), so no Hex dependency is needed; this differs from `llama_cpp_ex`, whose Hub needs
  the optional `:req` package. The `:http_client` option is the same test seam: a function
  `(url, opts)` returning `{:ok, %{status: integer, headers: headers, body: binary}}` (a
  `%Req.Response{}` qualifies) or `{:error, reason}`.
  """

  require Logger

  alias LlamaCppEx.Hub.{Cache, HTTP}

  @default_endpoint "https://huggingface.co"
  @download_keys [
    :cache_dir,
    :token,
    :revision,
    :force,
    :verify_checksum,
    :progress,
    :proxy,
    :no_proxy,
    :http_client,
    :endpoint
  ]
  @request_keys [:token, :revision, :proxy, :no_proxy, :http_client, :endpoint]
  @search_keys [:limit, :sort, :direction, :token, :proxy, :no_proxy, :http_client, :endpoint]

  @typedoc "An HTTP reply as the `:http_client` seam returns it."
  @type response :: %{status: integer(), headers: term(), body: binary()}

  @doc "Options `download/3` accepts."
  @spec download_option_keys() :: [atom()]
  def download_option_keys, do: @download_keys

  @doc """
  Searches GGUF repositories: `{:ok, [%{id, downloads, likes, last_modified, tags, private,
  gated}]}`.

  Options: `:limit` (10), `:sort` ("downloads", "likes" or "lastModified"), `:direction` (-1),
  `:token`, `:endpoint`, `:proxy`, `:no_proxy`.
  """
  @spec search(String.t(), keyword()) :: {:ok, [map()]} | {:error, String.t()}
  def search(query, opts \\ []) when is_binary(query) do
    opts = LlamaCppEx.Options.validate!(opts, @search_keys, "LlamaCppEx.Hub.search/2")

    params =
      URI.encode_query(
        search: query,
        filter: "gguf",
        sort: Keyword.get(opts, :sort, "downloads"),
        direction: Keyword.get(opts, :direction, -1),
        limit: Keyword.get(opts, :limit, 10)
      )

    case HTTP.get(endpoint(opts) <> "/api/models?" <> params, opts) do
      {:ok, %{status: 200, body: body}} ->
        with {:ok, list} when is_list(list) <- decode(body) do
          {:ok,
           Enum.map(list, fn m ->
             %{
               id: m["id"] || m["modelId"],
               downloads: m["downloads"] || 0,
               likes: m["likes"] || 0,
               last_modified: m["lastModified"],
               tags: m["tags"] || [],
               private: m["private"] || false,
               gated: m["gated"] || false
             }
           end)}
        else
          _ -> {:error, "HuggingFace search returned an unreadable body"}
        end

      {:ok, %{status: status}} ->
        {:error, "HuggingFace search returned status #{status}"}

      {:error, _} = e ->
        e
    end
  end

  @doc """
  The GGUF files of a repository, `{:ok, [%{filename, size}]}` sorted by size, from the tree
  API (`/api/models/<repo>/tree/<revision>`).
  """
  @spec list_gguf_files(String.t(), keyword()) :: {:ok, [map()]} | {:error, String.t()}
  def list_gguf_files(repo_id, opts \\ []) do
    opts = LlamaCppEx.Options.validate!(opts, @request_keys, "LlamaCppEx.Hub.list_gguf_files/2")
    rev = Keyword.get(opts, :revision, "main")

    with :ok <- Cache.guard(fn -> Cache.validate_component!(repo_id, "repository id") end),
         {:ok, body} <- api(repo_id, "/tree/#{rev}", opts),
         {:ok, entries} when is_list(entries) <- decode(body) do
      {:ok,
       entries
       |> Enum.filter(&(is_map(&1) and &1["type"] != "directory"))
       |> Enum.map(&%{"rfilename" => &1["path"], "size" => &1["size"]})
       |> filter_gguf_files()}
    else
      {:ok, _} -> {:error, "HuggingFace API returned an unreadable tree for #{repo_id}"}
      error -> error
    end
  end

  @doc "The repository's metadata (`/api/models/<repo>/revision/<rev>`) as a decoded map."
  @spec get_model_info(String.t(), keyword()) :: {:ok, map()} | {:error, String.t()}
  def get_model_info(repo_id, opts \\ []) do
    opts = LlamaCppEx.Options.validate!(opts, @request_keys, "LlamaCppEx.Hub.get_model_info/2")
    rev = Keyword.get(opts, :revision, "main")

    with :ok <- Cache.guard(fn -> Cache.validate_component!(repo_id, "repository id") end),
         {:ok, body} <- api(repo_id, "/revision/#{rev}?blobs=true", opts),
         {:ok, info} when is_map(info) <- decode(body) do
      {:ok, info}
    else
      {:ok, _} -> {:error, "HuggingFace API returned unreadable metadata for #{repo_id}"}
      error -> error
    end
  end

  @doc """
  `[%{filename, size}]` for the siblings whose `rfilename` ends in ".gguf", sorted by size (a
  missing size counts as 0).

      iex> LlamaCppEx.Hub.filter_gguf_files([
      ...>   %{"rfilename" => "b.gguf", "size" => 20},
      ...>   %{"rfilename" => "README.md", "size" => 1},
      ...>   %{"rfilename" => "a.gguf"}
      ...> ])
      [%{filename: "a.gguf", size: 0}, %{filename: "b.gguf", size: 20}]
  """
  @spec filter_gguf_files([map()]) :: [%{filename: String.t(), size: non_neg_integer()}]
  def filter_gguf_files(siblings) do
    siblings
    |> Enum.filter(&String.ends_with?(&1["rfilename"] || "", ".gguf"))
    |> Enum.map(&%{filename: &1["rfilename"], size: &1["size"] || 0})
    |> Enum.sort_by(& &1.size)
  end

  @doc """
  The download URL of a file.

      iex> LlamaCppEx.Hub.build_download_url("org/model", "model.gguf", endpoint: "https://huggingface.co")
      "https://huggingface.co/org/model/resolve/main/model.gguf"
  """
  @spec build_download_url(String.t(), String.t(), keyword()) :: String.t()
  def build_download_url(repo_id, filename, opts \\ []) do
    rev = Keyword.get(opts, :revision, "main")
    "#{endpoint(opts)}/#{repo_id}/resolve/#{URI.encode(rev)}/#{URI.encode(filename)}"
  end

  @doc """
  `[{"authorization", "Bearer <token>"}]` from `:token`, `HF_TOKEN` or
  `HUGGING_FACE_HUB_TOKEN` (first set wins), or `[]`.
  """
  @spec auth_headers(keyword()) :: [{String.t(), String.t()}]
  def auth_headers(opts), do: HTTP.auth_headers(opts)

  @doc """
  Where `download/3` puts a file: `<cache_dir>/<repo_id>/<revision>/<filename>`.

  Raises `ArgumentError` ("invalid repository id …", "invalid filename …", "invalid
  revision …") for values that could leave the cache directory: empty, `.`, `..` or `~`
  components, `//`, absolute paths, drive letters, backslashes, NUL bytes, non-strings.

      iex> LlamaCppEx.Hub.cache_path("org/model", "model.gguf", cache_dir: "/c")
      "/c/org/model/main/model.gguf"
  """
  @spec cache_path(String.t(), String.t(), keyword()) :: String.t()
  def cache_path(repo_id, filename, opts \\ []), do: Cache.path(repo_id, filename, opts)

  @doc """
  Downloads `filename` of `repo_id` into the cache (see the module docs) and returns
  `{:ok, local_path}`, or `{:error, message}`.

  Options: `:cache_dir`, `:token`, `:revision` ("main"), `:force` (false), `:verify_checksum`
  (`true` | `:best_effort` | `false`), `:progress` (a function of `{downloaded, total}`, or
  `true` for a progress line on stderr), `:endpoint`, `:proxy`, `:no_proxy`, `:http_client`.
  """
  @spec download(String.t(), String.t(), keyword()) :: {:ok, String.t()} | {:error, String.t()}
  def download(repo_id, filename, opts \\ []) do
    opts = LlamaCppEx.Options.validate!(opts, @download_keys, "LlamaCppEx.Hub.download/3")
    verify = Keyword.get(opts, :verify_checksum, true)

    with :ok <- check_verify(verify),
         {:ok, dest} <- Cache.guard_path(repo_id, filename, opts) do
      cond do
        File.regular?(dest) and not Keyword.get(opts, :force, false) ->
          {:ok, dest}

        Cache.offline?() ->
          {:error, "offline mode enabled but file not cached: #{repo_id}/#{filename}"}

        true ->
          with {:ok, sha} <- expected_sha(repo_id, filename, verify, opts) do
            fetch(repo_id, filename, dest, sha, opts)
          end
      end
    end
  end

  ## checksum

  defp check_verify(v) when v in [true, false, :best_effort], do: :ok

  defp check_verify(v),
    do: {:error, "invalid :verify_checksum #{inspect(v)}, expected true, :best_effort or false"}

  defp expected_sha(repo_id, filename, false, _opts) do
    Logger.info("integrity verification disabled for #{repo_id}/#{filename}")
    {:ok, nil}
  end

  defp expected_sha(repo_id, filename, verify, opts) do
    rev = Keyword.get(opts, :revision, "main")
    where = "#{repo_id}/#{filename}"

    case get_model_info(repo_id, Keyword.take(opts, @request_keys)) do
      {:ok, info} ->
        sibling = Enum.find(info["siblings"] || [], &(&1["rfilename"] == filename))
        sha = sibling && get_in(sibling, ["lfs", "sha256"])

        cond do
          sibling == nil ->
            {:error, "file not found in #{repo_id}@#{rev}: #{filename}"}

          is_binary(sha) ->
            {:ok, String.downcase(sha)}

          verify == :best_effort ->
            Logger.warning("#{where}: the repository publishes no SHA-256; not verified")
            {:ok, nil}

          true ->
            {:error,
             "#{where}: the repository publishes no SHA-256 for this file; pass " <>
               "verify_checksum: :best_effort or verify_checksum: false to download it unverified"}
        end

      {:error, reason} when verify == :best_effort ->
        Logger.warning("cannot verify #{where} (#{reason}); downloading unverified")
        {:ok, nil}

      {:error, reason} ->
        {:error,
         "cannot verify #{where}: #{reason} (pass verify_checksum: false to skip verification)"}
    end
  end

  ## the download itself

  defp fetch(repo_id, filename, dest, sha, opts) do
    url = build_download_url(repo_id, filename, opts)
    where = "#{repo_id}/#{filename}"
    :ok = Cache.mkdir_private(Path.dirname(dest))
    part = Cache.part_path(dest)

    result =
      with {:ok, io} <- Cache.open_exclusive(part) do
        try do
          HTTP.receive_into(url, io, where, opts)
        after
          File.close(io)
        end
      end

    with {:ok, digest, headers} <- result,
         :ok <- compare(digest, sha, where) do
      File.rename!(part, dest)
      Cache.write_etag(dest, headers)
      {:ok, dest}
    else
      error ->
        File.rm(part)
        error
    end
  end

  defp compare(_digest, nil, _where), do: :ok
  defp compare(digest, digest, _where), do: :ok

  defp compare(digest, expected, where),
    do: {:error, "checksum mismatch for #{where}: expected #{expected}, got #{digest}"}

  ## requests

  defp api(repo_id, route, opts) do
    case HTTP.get(endpoint(opts) <> "/api/models/" <> repo_id <> route, opts) do
      {:ok, %{status: 200, body: body}} -> {:ok, body}
      {:ok, %{status: 404}} -> {:error, "repository not found: #{repo_id}"}
      {:ok, %{status: status}} -> {:error, HTTP.status_error(status, repo_id)}
      {:error, _} = e -> e
    end
  end

  @doc false
  # The proxy options `:httpc` gets for `url` (see `LlamaCppEx.Hub.HTTP.proxy_request_options/2`).
  @spec proxy_request_options(String.t(), keyword()) :: keyword()
  def proxy_request_options(url, opts \\ []), do: HTTP.proxy_request_options(url, opts)

  defp endpoint(opts),
    do:
      String.trim_trailing(
        Keyword.get(opts, :endpoint) || env("HF_ENDPOINT") || @default_endpoint,
        "/"
      )

  defp env(name), do: HTTP.env(name)

  defp decode(body) do
    LlamaCppEx.JSON.decode(body)
  rescue
    _ -> :error
  end
end
