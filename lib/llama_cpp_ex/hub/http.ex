defmodule LlamaCppEx.Hub.HTTP do
  @moduledoc false
  # The Hub's HTTP layer on OTP's `:httpc` (`:ssl` verifying the peer against the OS's CA
  # store): whole-body GETs, a streamed download hashed as it arrives, proxies from the
  # options or the environment, and the `:http_client` seam (a function `(url, opts)`
  # returning `{:ok, %{status, headers, body}}` or `{:error, reason}`).

  import Bitwise
  require Logger

  alias LlamaCppEx.Hub.Progress

  @profile :llama_cpp_ex_hub

  # A whole-body GET, through the seam or :httpc.
  def get(url, opts) do
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

  @doc """
  `[{"authorization", "Bearer <token>"}]` from `:token`, `HF_TOKEN` or
  `HUGGING_FACE_HUB_TOKEN` (first set wins), or `[]`.
  """
  def auth_headers(opts) do
    case Keyword.get(opts, :token) || env("HF_TOKEN") || env("HUGGING_FACE_HUB_TOKEN") do
      nil -> []
      token -> [{"authorization", "Bearer " <> token}]
    end
  end

  def status_error(401, _where),
    do: "authentication required — set HF_TOKEN or pass :token option"

  def status_error(403, where),
    do: "access denied — #{where} may be gated: accept its terms on the Hub and use a token"

  def status_error(404, where), do: "not found: #{where}"
  def status_error(status, _where), do: "HuggingFace API returned status #{status}"

  @doc """
  Streams the body of `url` into `io`, hashing and reporting progress: `{:ok, sha256_hex,
  headers}`. An `:http_client` gets the contract's `into:` callback, `fun.({:data, chunk},
  {req, resp})` returning `{:cont, {req, resp}}`, to call in the calling process as Req does,
  and may instead return the whole body; only a 200 reply's bytes are written.
  """
  def receive_into(url, io, where, opts) do
    progress = progress(Keyword.get(opts, :progress), where)

    case Keyword.get(opts, :http_client) do
      nil -> stream_httpc(url, io, where, progress, opts)
      client -> receive_from_client(client, url, io, where, progress, opts)
    end
  end

  defp receive_from_client(client, url, io, where, progress, opts) do
    written = :counters.new(1, [:atomics])

    into = fn {:data, chunk}, {req, resp} ->
      if Map.get(resp, :status, 200) == 200 do
        :ok = IO.binwrite(io, chunk)
        :counters.add(written, 1, byte_size(chunk))
        Progress.advance(progress, byte_size(chunk), total_of(resp))
      end

      {:cont, {req, resp}}
    end

    case client.(url, headers: request_headers(opts), into: into) do
      {:ok, %{status: 200} = resp} ->
        # a client that ignored `into:` returns the body itself
        with body when is_binary(body) and body != "" <- Map.get(resp, :body),
             0 <- :counters.get(written, 1) do
          :ok = IO.binwrite(io, body)
          Progress.advance(progress, byte_size(body), byte_size(body))
        end

        Progress.finish(progress)
        {:ok, hash_written(io), Map.get(resp, :headers, [])}

      {:ok, %{status: status}} ->
        {:error, status_error(status, where)}

      {:error, reason} ->
        {:error, "network error: #{inspect(reason)}"}
    end
  end

  defp total_of(resp) do
    case header(Map.get(resp, :headers, []), "content-length") do
      nil -> nil
      n -> String.to_integer(n)
    end
  end

  # the bytes written, hashed from the file: a client may have written them either way
  defp hash_written(io) do
    {:ok, _} = :file.position(io, :bof)
    hex(hash_from(io, :crypto.hash_init(:sha256)))
  end

  defp hash_from(io, acc) do
    case IO.binread(io, 1 <<< 20) do
      :eof -> :crypto.hash_final(acc)
      data when is_binary(data) -> hash_from(io, :crypto.hash_update(acc, data))
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

        Progress.advance(progress, 0, total)
        stream_loop(ref, io, where, progress, %{t | headers: headers, total: total})

      {:http, {^ref, :stream, chunk}} ->
        :ok = IO.binwrite(io, chunk)
        Progress.advance(progress, byte_size(chunk), t.total)
        t = %{t | got: t.got + byte_size(chunk), hash: :crypto.hash_update(t.hash, chunk)}
        stream_loop(ref, io, where, progress, t)

      {:http, {^ref, :stream_end, _trailers}} ->
        if t.total != nil and t.got != t.total do
          {:error, "download of #{where} truncated: got #{t.got} of #{t.total} bytes"}
        else
          Progress.finish(progress)
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

  defp progress(nil, _where), do: Progress.new(nil)
  defp progress(false, _where), do: Progress.new(nil)
  defp progress(f, _where) when is_function(f, 1), do: Progress.new(f)

  defp progress(true, where) do
    Progress.new(fn
      {got, total} when is_integer(total) and total > 0 ->
        IO.write(:stderr, "\r#{where}: #{mb(got)} / #{mb(total)} MB (#{div(got * 100, total)}%)")
        if got >= total, do: IO.write(:stderr, "\n")

      {got, _} ->
        IO.write(:stderr, "\r#{where}: #{mb(got)} MB")
    end)
  end

  defp progress(other, _where),
    do:
      raise(
        ArgumentError,
        "invalid :progress #{inspect(other)}, expected a 1-arity function or true"
      )

  defp mb(bytes), do: :erlang.float_to_binary(bytes / 1_048_576, decimals: 1)

  @doc """
  `[]`, or `[connect_options: [proxy: {scheme, host, port, []}, proxy_headers: …]]` for the
  proxy that applies to `url`: the `:proxy` option (a URL, a tuple or `false`), else
  HTTPS_PROXY / HTTP_PROXY (either case), else ALL_PROXY; none for hosts matched by
  `:no_proxy` / NO_PROXY (exact hosts, ".suffix", "*"). SOCKS proxies are skipped.
  """
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

  def env(name) do
    case System.get_env(name) do
      "" -> nil
      v -> v
    end
  end

  def header(headers, name) when is_map(headers) do
    case Map.get(headers, name) do
      [v | _] -> v
      v when is_binary(v) -> v
      _ -> nil
    end
  end

  def header(headers, name) when is_list(headers) do
    Enum.find_value(headers, fn {k, v} ->
      if String.downcase(to_string(k)) == name, do: to_string(v)
    end)
  end

  defp hex(bin), do: Base.encode16(bin, case: :lower)
end
