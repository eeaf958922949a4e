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
  @profile :llama_cpp_ex_hub

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

    case get(endpoint(opts) <> "/api/models?" <> params, opts) do
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

    with :ok <- guard(fn -> validate_component!(repo_id, "repository id") end),
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

    with :ok <- guard(fn -> validate_component!(repo_id, "repository id") end),
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
  def auth_headers(opts) do
    case Keyword.get(opts, :token) || env("HF_TOKEN") || env("HUGGING_FACE_HUB_TOKEN") do
      nil -> []
      token -> [{"authorization", "Bearer " <> token}]
    end
  end

  @doc """
  Where `download/3` puts a file: `<cache_dir>/<repo_id>/<revision>/<filename>`.

  Raises `ArgumentError` ("invalid repository id …", "invalid filename …", "invalid
  revision …") for values that could leave the cache directory: empty, `.`, `..` or `~`
  components, `//`, absolute paths, drive letters, backslashes, NUL bytes, non-strings.

      iex> LlamaCppEx.Hub.cache_path("org/model", "model.gguf", cache_dir: "/c")
      "/c/org/model/main/model.gguf"
  """
  @spec cache_path(String.t(), String.t(), keyword()) :: String.t()
  def cache_path(repo_id, filename, opts \\ []) do
    rev = Keyword.get(opts, :revision, "main")
    validate_component!(repo_id, "repository id")
    validate_component!(filename, "filename")
    validate_component!(rev, "revision")
    Path.join([cache_dir(opts), repo_id, rev, filename])
  end

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
         {:ok, dest} <- guard_path(repo_id, filename, opts) do
      cond do
        File.regular?(dest) and not Keyword.get(opts, :force, false) ->
          {:ok, dest}

        offline?() ->
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
    :ok = mkdir_private(Path.dirname(dest))
    part = dest <> "." <> random_suffix() <> ".part"

    result =
      with {:ok, io} <- open_exclusive(part) do
        try do
          receive_into(url, io, where, opts)
        after
          File.close(io)
        end
      end

    with {:ok, digest, headers} <- result,
         :ok <- compare(digest, sha, where) do
      File.rename!(part, dest)
      write_etag(dest, headers)
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

  defp open_exclusive(path) do
    case File.open(path, [:write, :exclusive, :binary, :raw]) do
      {:ok, io} ->
        File.chmod(path, 0o600)
        {:ok, io}

      {:error, reason} ->
        {:error, "cannot create #{path}: #{:file.format_error(reason)}"}
    end
  end

  defp write_etag(dest, headers) do
    case header(headers, "x-linked-etag") || header(headers, "etag") do
      nil ->
        :ok

      etag ->
        path = dest <> ".etag"
        File.write(path, etag)
        File.chmod(path, 0o600)
    end
  end

  defp random_suffix, do: Base.url_encode64(:crypto.strong_rand_bytes(16), padding: false)

  defp mkdir_private(dir) do
    # every directory created on the way gets 0700
    dir
    |> Path.split()
    |> Enum.scan(&Path.join(&2, &1))
    |> Enum.each(fn d ->
      unless File.dir?(d) do
        File.mkdir(d)
        File.chmod(d, 0o700)
      end
    end)

    :ok
  end

  # Streams the body into `io`, hashing and reporting progress: {:ok, sha256_hex, headers}.
  defp receive_into(url, io, where, opts) do
    progress = progress_fun(Keyword.get(opts, :progress), where)

    case Keyword.get(opts, :http_client) do
      nil ->
        stream_httpc(url, io, where, progress, opts)

      client ->
        case client.(url, headers: request_headers(opts)) do
          {:ok, %{status: 200, body: body} = resp} ->
            :ok = IO.binwrite(io, body)
            progress.({byte_size(body), byte_size(body)})
            {:ok, hex(:crypto.hash(:sha256, body)), resp.headers}

          {:ok, %{status: status}} ->
            {:error, status_error(status, where)}

          {:error, reason} ->
            {:error, "network error: #{inspect(reason)}"}
        end
    end
  end

  defp stream_httpc(url, io, where, progress, opts) do
    with {:ok, profile} <- start_httpc(url, opts) do
      request = {String.to_charlist(url), httpc_headers(opts)}
      http_opts = [timeout: :infinity, connect_timeout: 30_000, autoredirect: true] ++ ssl(url)

      case :httpc.request(:get, request, http_opts, [sync: false, stream: :self], profile) do
        {:ok, ref} ->
          t = %{headers: [], total: nil, got: 0, hash: :crypto.hash_init(:sha256)}
          stream_loop(ref, io, where, progress, t)

        {:error, reason} ->
          {:error, "network error: #{inspect(reason)}"}
      end
    end
  end

  # The transfer so far: the reply's headers, its announced length, the bytes and their hash.
  defp stream_loop(ref, io, where, progress, t) do
    receive do
      {:http, {^ref, :stream_start, headers}} ->
        total =
          case header(headers, "content-length") do
            nil -> nil
            n -> String.to_integer(n)
          end

        progress.({0, total})
        stream_loop(ref, io, where, progress, %{t | headers: headers, total: total})

      {:http, {^ref, :stream, chunk}} ->
        :ok = IO.binwrite(io, chunk)
        got = t.got + byte_size(chunk)
        progress.({got, t.total})
        t = %{t | got: got, hash: :crypto.hash_update(t.hash, chunk)}
        stream_loop(ref, io, where, progress, t)

      {:http, {^ref, :stream_end, _trailers}} ->
        if t.total != nil and t.got != t.total do
          {:error, "download of #{where} truncated: got #{t.got} of #{t.total} bytes"}
        else
          {:ok, hex(:crypto.hash_final(t.hash)), t.headers}
        end

      {:http, {^ref, {{_, status, _}, _headers, _body}}} ->
        {:error, status_error(status, where)}

      {:http, {^ref, {:error, {:failed_connect, _} = reason}}} ->
        {:error, "network error: #{inspect(reason)}"}

      {:http, {^ref, {:error, reason}}} ->
        # the connection ended mid-body (httpc may not have passed any of it on yet)
        {:error,
         "download of #{where} truncated: the connection closed after #{t.got} of " <>
           "#{t.total || "?"} bytes (#{inspect(reason)})"}
    end
  end

  defp progress_fun(nil, _where), do: fn _ -> :ok end
  defp progress_fun(false, _where), do: fn _ -> :ok end
  defp progress_fun(f, _where) when is_function(f, 1), do: f

  defp progress_fun(true, where) do
    fn
      {got, total} when is_integer(total) and total > 0 ->
        IO.write(:stderr, "\r#{where}: #{mb(got)} / #{mb(total)} MB (#{div(got * 100, total)}%)")
        if got >= total, do: IO.write(:stderr, "\n")

      {got, _} ->
        IO.write(:stderr, "\r#{where}: #{mb(got)} MB")
    end
  end

  defp progress_fun(other, _where),
    do:
      raise(
        ArgumentError,
        "invalid :progress #{inspect(other)}, expected a 1-arity function or true"
      )

  defp mb(bytes), do: :erlang.float_to_binary(bytes / 1_048_576, decimals: 1)

  ## requests

  defp api(repo_id, route, opts) do
    case get(endpoint(opts) <> "/api/models/" <> repo_id <> route, opts) do
      {:ok, %{status: 200, body: body}} -> {:ok, body}
      {:ok, %{status: 404}} -> {:error, "repository not found: #{repo_id}"}
      {:ok, %{status: status}} -> {:error, status_error(status, repo_id)}
      {:error, _} = e -> e
    end
  end

  defp status_error(401, _where),
    do: "authentication required — set HF_TOKEN or pass :token option"

  defp status_error(403, where),
    do: "access denied — #{where} may be gated: accept its terms on the Hub and use a token"

  defp status_error(404, where), do: "not found: #{where}"
  defp status_error(status, _where), do: "HuggingFace API returned status #{status}"

  # A whole-body GET, through the seam or :httpc.
  defp get(url, opts) do
    case Keyword.get(opts, :http_client) do
      nil ->
        with {:ok, profile} <- start_httpc(url, opts) do
          request = {String.to_charlist(url), httpc_headers(opts)}
          http_opts = [timeout: 60_000, connect_timeout: 30_000, autoredirect: true] ++ ssl(url)

          case :httpc.request(:get, request, http_opts, [body_format: :binary], profile) do
            {:ok, {{_, status, _}, headers, body}} ->
              {:ok, %{status: status, headers: headers, body: body}}

            {:error, reason} ->
              {:error, "network error: #{inspect(reason)}"}
          end
        end

      client ->
        case client.(url, headers: request_headers(opts)) do
          {:ok, %{status: _} = resp} -> {:ok, resp}
          {:error, reason} -> {:error, "network error: #{inspect(reason)}"}
        end
    end
  end

  defp request_headers(opts), do: [{"user-agent", "llama_cpp_ex"} | auth_headers(opts)]

  defp httpc_headers(opts),
    do:
      Enum.map(request_headers(opts), fn {k, v} ->
        {String.to_charlist(k), String.to_charlist(v)}
      end)

  # The :httpc profile for `url`: a plain one, or (when a proxy applies) one whose proxy is
  # set; {:ok, profile}.
  defp start_httpc(url, opts) do
    with {:ok, _} <- Application.ensure_all_started(:inets),
         {:ok, _} <- Application.ensure_all_started(:ssl) do
      case proxy_request_options(url, opts) do
        [{:connect_options, [{:proxy, {_scheme, host, port, _}} | _]}] ->
          profile = start_profile(:llama_cpp_ex_hub_proxy)
          proxy = {{String.to_charlist(host), port}, []}
          :ok = :httpc.set_options([proxy: proxy, https_proxy: proxy], profile)
          {:ok, profile}

        [] ->
          {:ok, start_profile(@profile)}
      end
    else
      {:error, reason} -> {:error, "network error: cannot start :inets/:ssl: #{inspect(reason)}"}
    end
  end

  defp start_profile(profile) do
    case :inets.start(:httpc, profile: profile) do
      {:ok, _} -> profile
      {:error, {:already_started, _}} -> profile
    end
  end

  defp ssl("https" <> _) do
    [
      ssl: [
        verify: :verify_peer,
        cacerts: :public_key.cacerts_get(),
        depth: 4,
        customize_hostname_check: [match_fun: :public_key.pkix_verify_hostname_match_fun(:https)]
      ]
    ]
  end

  defp ssl(_), do: []

  @doc false
  # `[]`, or `[connect_options: [proxy: {scheme, host, port, []}, proxy_headers: …]]` for the
  # proxy that applies to `url`: the `:proxy` option (a URL, a tuple or `false`), else
  # HTTPS_PROXY / HTTP_PROXY (either case), else ALL_PROXY; none for hosts matched by
  # `:no_proxy` / NO_PROXY (exact hosts, ".suffix", "*"). SOCKS proxies are skipped.
  @spec proxy_request_options(String.t(), keyword()) :: keyword()
  def proxy_request_options(url, opts \\ []) do
    host = URI.parse(url).host || ""

    source =
      case Keyword.fetch(opts, :proxy) do
        {:ok, false} -> nil
        {:ok, p} -> p
        :error -> env_proxy(URI.parse(url).scheme)
      end

    no_proxy = Keyword.get(opts, :no_proxy) || env("NO_PROXY") || env("no_proxy") || ""

    cond do
      source in [nil, ""] -> []
      bypass?(host, no_proxy) -> []
      true -> proxy_options(source)
    end
  end

  defp env_proxy("https"),
    do: env("HTTPS_PROXY") || env("https_proxy") || env("ALL_PROXY") || env("all_proxy")

  defp env_proxy(_),
    do: env("HTTP_PROXY") || env("http_proxy") || env("ALL_PROXY") || env("all_proxy")

  defp bypass?(host, no_proxy) when is_binary(no_proxy),
    do: bypass?(host, String.split(no_proxy, ",", trim: true))

  defp bypass?(host, list) do
    Enum.any?(list, fn entry ->
      entry = String.trim(entry)

      cond do
        entry == "*" -> true
        String.starts_with?(entry, ".") -> String.ends_with?(host, entry)
        true -> host == entry or String.ends_with?(host, "." <> entry)
      end
    end)
  end

  defp proxy_options({scheme, host, port, extra}),
    do: [connect_options: [proxy: {scheme, host, port, extra}]]

  defp proxy_options(url) when is_binary(url) do
    uri = URI.parse(if String.contains?(url, "://"), do: url, else: "http://" <> url)

    case uri.scheme do
      "socks" <> _ ->
        Logger.warning("SOCKS proxies are not supported; ignoring #{uri.host}")
        []

      scheme ->
        auth =
          case uri.userinfo do
            nil ->
              []

            info ->
              [
                proxy_headers: [
                  {"proxy-authorization", "Basic " <> Base.encode64(URI.decode(info))}
                ]
              ]
          end

        [connect_options: [proxy: {String.to_atom(scheme), uri.host, uri.port || 80, []}] ++ auth]
    end
  end

  ## paths

  defp guard_path(repo_id, filename, opts) do
    {:ok, cache_path(repo_id, filename, opts)}
  rescue
    e in ArgumentError -> {:error, Exception.message(e)}
  end

  defp guard(fun) do
    fun.()
    :ok
  rescue
    e in ArgumentError -> {:error, Exception.message(e)}
  end

  defp validate_component!(value, what) when not is_binary(value),
    do: raise(ArgumentError, "invalid #{what} #{inspect(value)}: expected a string")

  defp validate_component!("", what),
    do: raise(ArgumentError, "invalid #{what}: must not be empty")

  defp validate_component!(value, what) do
    bad =
      cond do
        String.contains?(value, <<0>>) -> "contains a null byte"
        String.contains?(value, "\\") -> "contains a backslash"
        String.starts_with?(value, "/") -> "is an absolute path"
        Regex.match?(~r/^[A-Za-z]:/, value) -> "starts with a drive letter"
        String.contains?(value, "//") -> "contains an empty component"
        true -> bad_component(String.split(value, "/"))
      end

    if bad, do: raise(ArgumentError, "invalid #{what} #{inspect(value)}: #{bad}")
    :ok
  end

  defp bad_component(parts) do
    Enum.find_value(parts, fn
      "" -> "contains an empty component"
      "." -> "contains a \".\" component"
      ".." -> "contains a \"..\" component"
      "~" <> _ -> "contains a \"~\" component"
      _ -> nil
    end)
  end

  defp cache_dir(opts) do
    Keyword.get(opts, :cache_dir) || env("LLAMA_CACHE_DIR") ||
      Path.join(System.user_home!(), ".cache/llama_cpp_ex/models")
  end

  defp endpoint(opts),
    do:
      String.trim_trailing(
        Keyword.get(opts, :endpoint) || env("HF_ENDPOINT") || @default_endpoint,
        "/"
      )

  defp offline?, do: env("LLAMA_OFFLINE") in ["1", "true"]

  defp env(name) do
    case System.get_env(name) do
      "" -> nil
      v -> v
    end
  end

  defp header(headers, name) when is_map(headers) do
    case Map.get(headers, name) do
      [v | _] -> v
      v when is_binary(v) -> v
      _ -> nil
    end
  end

  defp header(headers, name) when is_list(headers) do
    Enum.find_value(headers, fn {k, v} ->
      if String.downcase(to_string(k)) == name, do: to_string(v)
    end)
  end

  defp decode(body) do
    LlamaCppEx.JSON.decode(body)
  rescue
    _ -> :error
  end

  defp hex(bin), do: Base.encode16(bin, case: :lower)
end
